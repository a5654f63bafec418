"""/v1/chat/completions: the conversation under the tokenizer's chat template becomes one engine
request (n choices), answered whole or as a stream of the engine's deltas."""

import time
from collections.abc import AsyncIterator

from paged_jax.core.llm import chat_prompt
from paged_jax.serving.openai_base import OpenAIBase, Prompt, num_tokens, random_id, usage
from paged_jax.serving.openai_errors import bad_request
from paged_jax.serving.openai_protocol import (AssistantMessage, ChatCompletionChoice, ChatCompletionChunk,
                                               ChatCompletionRequest, ChatCompletionResponse,
                                               ChatCompletionStreamChoice, ChatMessage, DeltaMessage)
from paged_jax.serving.openai_streams import EventStream, ending, finals, sse
from paged_jax.serving.request_stream import RequestStream


class ChatServing(OpenAIBase):
    async def create_chat_completion(self, request: ChatCompletionRequest) -> ChatCompletionResponse | EventStream:
        self._check_model(request.model)
        if request.top_logprobs is not None and not request.logprobs:
            raise bad_request("top_logprobs needs logprobs set to true", "top_logprobs")
        prompt = Prompt(None, self._chat_ids(request.messages, request.add_generation_prompt))
        if request.max_completion_tokens is not None:
            max_tokens, name = request.max_completion_tokens, "max_completion_tokens"
        else:
            max_tokens, name = request.max_tokens, "max_tokens"
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
        params = self._sampling_params(request, len(prompt.token_ids), max_tokens, name, logprobs)
        response_id = random_id("chatcmpl")
        streams = await self._submit(response_id, [prompt], [params], request)
        if request.stream:
            return EventStream(ending(self._chat_events(response_id, request, prompt, streams[0])), streams)
        [final] = await finals(streams)
        choices = [ChatCompletionChoice(
            index=c.index, message=AssistantMessage(content=c.text),
            logprobs=self.logprobs.chat(c.token_ids, c.logprobs, logprobs) if request.logprobs else None,
            finish_reason=c.finish_reason, stop_reason=c.stop_reason) for c in final.outputs]
        return ChatCompletionResponse(id=response_id, model=self.model_name, choices=choices,
                                      usage=usage([prompt], num_tokens([final])))

    async def _chat_events(self, response_id: str, request: ChatCompletionRequest, prompt: Prompt,
                           stream: RequestStream) -> AsyncIterator[str]:
        created = int(time.time())

        def chunk(choices, usage_info=None) -> str:
            return sse(ChatCompletionChunk(id=response_id, created=created, model=self.model_name, choices=choices,
                                           usage=usage_info))

        # The role comes first, as OpenAI sends it, before any token exists.
        yield chunk([ChatCompletionStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))
                     for i in range(request.n)])
        completion_tokens = 0
        async for out in stream:
            completion_tokens += num_tokens([out])
            for c in out.outputs:
                logprobs = self.logprobs.chat(c.token_ids, c.logprobs, request.top_logprobs or 0) if request.logprobs else None
                yield chunk([ChatCompletionStreamChoice(
                    index=c.index, delta=DeltaMessage(content=c.text), logprobs=logprobs,
                    finish_reason=c.finish_reason, stop_reason=c.stop_reason)])
        if request.stream_options and request.stream_options.include_usage:
            yield chunk([], usage([prompt], completion_tokens))

    def _chat_ids(self, messages: list[ChatMessage], add_generation_prompt: bool, **options) -> list[int]:
        if self.tokenizer is None or self.tokenizer.chat_template is None:
            raise bad_request("this model has no chat template: use /v1/completions", "messages")
        conversation = [{"role": m.role, "content": _content_text(m.content)} for m in messages]
        try:
            return chat_prompt(self.tokenizer, conversation, add_generation_prompt=add_generation_prompt, **options)
        except Exception as e:  # the template refused the conversation (roles out of order, say)
            raise bad_request(f"the chat template failed on these messages: {e}", "messages") from e


def _content_text(content: str | list | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(part.text for part in content)
