"""/v1/completions: one engine request per prompt (n choices each), answered whole or as a stream of
the engine's deltas."""

import contextlib
import time
from collections.abc import AsyncIterator

from paged_jax.core.outputs import RequestOutput
from paged_jax.serving.openai_base import OpenAIBase, Prompt, cached_tokens, num_tokens, random_id, usage
from paged_jax.serving.openai_errors import bad_request
from paged_jax.serving.openai_protocol import CompletionChoice, CompletionRequest, CompletionResponse
from paged_jax.serving.openai_streams import EventStream, ending, finals, merge, sse
from paged_jax.serving.request_stream import RequestStream


class CompletionServing(OpenAIBase):
    async def create_completion(self, request: CompletionRequest) -> CompletionResponse | EventStream:
        model, lora = self._check_model(request.model)
        if request.best_of is not None and request.best_of != request.n:
            raise bad_request(f"best_of={request.best_of} is not supported: only best_of equal to n "
                              f"(here {request.n}), as nothing is re-ranked", "best_of", code="unsupported_parameter")
        if request.echo and request.logprobs is not None:
            raise bad_request("echo with logprobs needs the prompt's logprobs, which this server does not compute",
                              "echo", code="unsupported_parameter")
        prompts = self._completion_prompts(request.prompt)
        constraint = await self._constraint(request)
        params = [self._sampling_params(request, len(p.token_ids), request.max_tokens, "max_tokens", request.logprobs,
                                        constraint.structured_outputs, default_max_tokens=16) for p in prompts]
        response_id = random_id("cmpl")
        streams = await self._submit(response_id, prompts, params, request, lora)
        if request.stream:
            return EventStream(ending(self._completion_events(response_id, model, request, prompts, streams)), streams)
        outputs = await finals(streams)
        choices = []
        for p, final in zip(prompts, outputs):
            for c in final.outputs:
                text = (self._prompt_text(p) if request.echo else "") + c.text
                logprobs = (self.logprobs.completion(c.token_ids, c.logprobs, request.logprobs, 0)
                            if request.logprobs is not None else None)
                choices.append(CompletionChoice(index=len(choices), text=text, logprobs=logprobs,
                                                finish_reason=c.finish_reason, stop_reason=c.stop_reason))
        return CompletionResponse(id=response_id, model=model, choices=choices,
                                  usage=usage(prompts, num_tokens(outputs), cached_tokens(outputs)))

    def _completion_prompts(self, prompt: str | list) -> list[Prompt]:
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompt = [prompt]
        if not prompt:
            raise bad_request("prompt is empty", "prompt")
        return [Prompt(p, self._encode(p)) if isinstance(p, str) else Prompt(None, list(p)) for p in prompt]

    async def _completion_events(self, response_id: str, model: str, request: CompletionRequest, prompts: list[Prompt],
                                 streams: list[RequestStream]) -> AsyncIterator[str]:
        """One event per delta of a choice; the first of a choice leads with the prompt under echo."""
        created = int(time.time())
        text_offsets: dict[int, int] = {}  # completions' logprobs: where a choice's next token starts
        completion_tokens = 0
        latest: dict[int, RequestOutput] = {}  # each prompt's last output, for its cached tokens
        async with contextlib.aclosing(merge(streams)) as outputs:
            async for i, out in outputs:
                completion_tokens += num_tokens([out])
                latest[i] = out
                for c in out.outputs:
                    index = i * request.n + c.index
                    text = c.text
                    if index not in text_offsets and request.echo:
                        text = self._prompt_text(prompts[i]) + text
                    offset = text_offsets.setdefault(index, 0)
                    logprobs = None
                    if request.logprobs is not None:
                        logprobs = self.logprobs.completion(c.token_ids, c.logprobs, request.logprobs, offset)
                        text_offsets[index] += sum(map(len, logprobs.tokens))
                    choice = CompletionChoice(index=index, text=text, logprobs=logprobs,
                                              finish_reason=c.finish_reason, stop_reason=c.stop_reason)
                    yield sse(CompletionResponse(id=response_id, created=created, model=model, choices=[choice]))
        if request.stream_options and request.stream_options.include_usage:
            total = usage(prompts, completion_tokens, cached_tokens(list(latest.values())))
            yield sse(CompletionResponse(id=response_id, created=created, model=model, choices=[],
                                         usage=total))
