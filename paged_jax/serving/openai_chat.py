"""/v1/chat/completions: the conversation under the tokenizer's chat template becomes one engine
request (n choices), answered whole or as a stream of the engine's deltas. With tools, each choice's
text is read for tool calls (tool_parsers.py): a reply carries them in message.tool_calls, a stream
sends each call whole in one delta once it is complete."""

import time
from collections.abc import AsyncIterator

from paged_jax.core.llm import chat_prompt
from paged_jax.serving.openai_base import OpenAIBase, Prompt, cached_tokens, num_tokens, random_id, usage
from paged_jax.serving.openai_errors import bad_request
from paged_jax.serving.openai_protocol import (AssistantMessage, ChatCompletionChoice, ChatCompletionChunk,
                                               ChatCompletionRequest, ChatCompletionResponse,
                                               ChatCompletionStreamChoice, ChatMessage, DeltaMessage)
from paged_jax.serving.openai_streams import EventStream, ending, finals, sse
from paged_jax.serving.request_stream import RequestStream
from paged_jax.serving.structured_requests import RequestConstraint
from paged_jax.serving.tool_messages import template_message, tool_call_deltas, tool_call_out
from paged_jax.serving.tool_parsers import ToolCallStream


class ChatServing(OpenAIBase):
    async def create_chat_completion(self, request: ChatCompletionRequest) -> ChatCompletionResponse | EventStream:
        model, lora = self._check_model(request.model)
        if request.top_logprobs is not None and not request.logprobs:
            raise bad_request("top_logprobs needs logprobs set to true", "top_logprobs")
        constraint = await self._constraint(request)
        tools = [t.model_dump(exclude_none=True) for t in request.tools] if request.tools else None
        prompt = Prompt(None, self._chat_ids(request.messages, request.add_generation_prompt, tools=tools))
        if request.max_completion_tokens is not None:
            max_tokens, name = request.max_completion_tokens, "max_completion_tokens"
        else:
            max_tokens, name = request.max_tokens, "max_tokens"
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
        params = self._sampling_params(request, len(prompt.token_ids), max_tokens, name, logprobs,
                                       constraint.structured_outputs)
        response_id = random_id("chatcmpl")
        streams = await self._submit(response_id, [prompt], [params], request, lora)
        if request.stream:
            return EventStream(ending(self._chat_events(response_id, model, request, prompt, streams[0], constraint)),
                               streams)
        [final] = await finals(streams)
        choices = []
        for c in final.outputs:
            content, calls = c.text, []
            if constraint.parser is not None:
                content, calls = _tool_reader(constraint).update(c.text, final=True)
            choices.append(ChatCompletionChoice(
                index=c.index, message=AssistantMessage(content=content or None if calls else content,
                                                        tool_calls=[tool_call_out(t) for t in calls]),
                logprobs=self.logprobs.chat(c.token_ids, c.logprobs, logprobs) if request.logprobs else None,
                finish_reason=_finish_reason(c.finish_reason, calls), stop_reason=c.stop_reason))
        return ChatCompletionResponse(id=response_id, model=model, choices=choices,
                                      usage=usage([prompt], num_tokens([final]), cached_tokens([final])))

    async def _chat_events(self, response_id: str, model: str, request: ChatCompletionRequest, prompt: Prompt,
                           stream: RequestStream, constraint: RequestConstraint) -> AsyncIterator[str]:
        created = int(time.time())

        def chunk(choices, usage_info=None) -> str:
            return sse(ChatCompletionChunk(id=response_id, created=created, model=model, choices=choices,
                                           usage=usage_info))

        # The role comes first, as OpenAI sends it, before any token exists.
        yield chunk([ChatCompletionStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))
                     for i in range(request.n)])
        completion_tokens, last = 0, None
        # With a tool parser: each choice's text so far, and what of it has been read.
        texts: dict[int, str] = {}
        readers: dict[int, ToolCallStream] = {}
        async for out in stream:
            completion_tokens, last = completion_tokens + num_tokens([out]), out
            for c in out.outputs:
                content, calls, called = c.text, [], []
                if constraint.parser is not None:
                    texts[c.index] = texts.get(c.index, "") + c.text
                    reader = readers.setdefault(c.index, _tool_reader(constraint))
                    content, new = reader.update(texts[c.index], c.finished)
                    calls, called = tool_call_deltas(new, len(reader.calls) - len(new)), reader.calls
                logprobs = self.logprobs.chat(c.token_ids, c.logprobs, request.top_logprobs or 0) if request.logprobs else None
                yield chunk([ChatCompletionStreamChoice(
                    index=c.index, delta=DeltaMessage(content=content, tool_calls=calls or None), logprobs=logprobs,
                    finish_reason=_finish_reason(c.finish_reason, called), stop_reason=c.stop_reason)])
        if request.stream_options and request.stream_options.include_usage:
            yield chunk([], usage([prompt], completion_tokens, cached_tokens([last] if last else [])))

    def _chat_ids(self, messages: list[ChatMessage], add_generation_prompt: bool, **options) -> list[int]:
        template = self.chat_template or getattr(self.tokenizer, "chat_template", None)
        if self.tokenizer is None or template is None:
            # As vLLM does since transformers dropped default templates: no guessing at a prompt format.
            raise bad_request("this model's tokenizer has no chat template: start the server with --chat-template "
                              "(a Jinja template or a file holding one), or use /v1/completions", "messages")
        conversation = [template_message(m, _content_text(m.content)) for m in messages]
        try:
            return chat_prompt(self.tokenizer, conversation, add_generation_prompt=add_generation_prompt,
                               chat_template=template, **options)
        except Exception as e:  # the template refused the conversation (roles out of order, say)
            raise bad_request(f"the chat template failed on these messages: {e}", "messages") from e


def _tool_reader(constraint: RequestConstraint) -> ToolCallStream:
    return ToolCallStream(constraint.parser, single_call=constraint.single_call)


def _finish_reason(reason: str | None, calls: list) -> str | None:
    return "tool_calls" if calls and reason == "stop" else reason


def _content_text(content: str | list | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(part.text for part in content)
