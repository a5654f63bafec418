"""What completions and chat completions share: an OpenAI request becomes engine requests.

The checks that can refuse a request run before the first engine request is added. The engine's own
(token ids, context length, priority, sampling parameters: core/validation.py) raise RequestError,
which becomes a 400 here; the checks written here are the server's own (its token cap, its timeout,
n within max_num_seqs, a completion's room in the context).
"""

import dataclasses
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING

from paged_jax.core.errors import RequestError
from paged_jax.core.lora_request import LoRARequest
from paged_jax.core.outputs import RequestOutput
from paged_jax.core.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams
from paged_jax.core.validation import check_prompt_length
from paged_jax.serving.async_engine import AsyncLLMEngine, RequestStream
from paged_jax.serving.lora_modules import LoRAModules
from paged_jax.serving.openai_errors import APIError, bad_request, refused
from paged_jax.serving.openai_logprobs import LogprobFormatter
from paged_jax.serving.openai_protocol import PromptTokenUsageInfo, SamplingRequest, UsageInfo
from paged_jax.serving.structured_requests import RequestConstraint, compiled, request_constraint

if TYPE_CHECKING:  # slo.py builds on this module's errors
    from paged_jax.serving.slo import SloGuard


@dataclasses.dataclass(frozen=True)
class Prompt:
    text: str | None  # None when given as token ids
    token_ids: list[int]


def random_id(prefix: str) -> str:
    """A response's id: OpenAI's prefix ("cmpl", "chatcmpl") and a random hex."""
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompts: list[Prompt], completion_tokens: int, cached_tokens: int) -> UsageInfo:
    """cached_tokens: of the prompts' tokens, those the prefix cache served (OpenAI's
    prompt_tokens_details.cached_tokens, sent always, 0 included, as OpenAI does)."""
    prompt_tokens = sum(len(p.token_ids) for p in prompts)
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens,
                     prompt_tokens_details=PromptTokenUsageInfo(cached_tokens=cached_tokens))


def cached_tokens(outputs: Sequence[RequestOutput]) -> int:
    """Prompt tokens served from the prefix cache, over the latest outputs of a response's requests."""
    return sum(out.metrics.num_prefix_hit_tokens for out in outputs)


def num_tokens(outputs: Sequence[RequestOutput]) -> int:
    return sum(len(c.token_ids) for out in outputs for c in out.outputs)


class OpenAIBase:
    def __init__(self, engine: AsyncLLMEngine, models: LoRAModules, *, max_tokens_cap: int | None = None,
                 request_timeout: float | None = None, guard: "SloGuard | None" = None,
                 auto_tool_parser: str | None = None, chat_template: str | None = None):
        """models: the base model's name and the LoRA adapters a request may name. max_tokens_cap: the most tokens one request may ask for. request_timeout: seconds a request
        may take at most (each request may ask for less). guard: latency objectives (slo.py).
        auto_tool_parser: the tool_parsers.PARSERS name tool_choice "auto" reads calls with (None:
        "auto" is refused). chat_template: the Jinja template chats are rendered with (vLLM's
        --chat-template; None: the tokenizer's own)."""
        self.engine = engine
        self.guard = guard
        self.models = models
        self.max_tokens_cap = max_tokens_cap
        self.request_timeout = request_timeout
        self.tokenizer = engine.tokenizer
        self.limits = engine.limits
        self.logprobs = LogprobFormatter(self.tokenizer)
        self.auto_tool_parser = auto_tool_parser
        self.chat_template = chat_template

    def _check_model(self, name: str | None) -> tuple[str, LoRARequest | None]:
        """The name a response gives as its model, and the LoRA adapter `name` runs (None: the base model);
        vLLM's 404 for a name this server does not serve."""
        lora = self.models.resolve(name)
        return (self.models.base_name if lora is None else lora.lora_name), lora

    def _encode(self, text: str, **options) -> list[int]:
        if self.tokenizer is None:
            raise bad_request("this model has no tokenizer: send prompts as token ids", "prompt")
        return self.tokenizer.encode(text, **options)

    def _decode(self, ids: Sequence[int]) -> str:
        if self.tokenizer is None:
            raise bad_request("this model has no tokenizer: it speaks token ids only", "tokens")
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _prompt_text(self, prompt: Prompt) -> str:
        return prompt.text if prompt.text is not None else self._decode(prompt.token_ids)

    async def _constraint(self, request: SamplingRequest) -> RequestConstraint:
        """The request's constraint, compiled (off the event loop, and cached for the engine), or a 400
        naming the field at fault."""
        try:
            constraint = request_constraint(request, auto_tool_parser=self.auto_tool_parser)
            for param, so in constraint.checks:
                await compiled(self.engine.grammars, so, param)
        except RequestError as e:
            raise refused(e) from e
        return constraint

    def _sampling_params(self, request: SamplingRequest, prompt_len: int, max_tokens: int | None, name: str,
                         logprobs: int | None, structured_outputs: StructuredOutputsParams | None = None, *,
                         default_max_tokens: int | None = None) -> SamplingParams:
        """The request's SamplingParams for a prompt of prompt_len tokens; refuses what cannot fit.
        Without max_tokens, a request gets default_max_tokens (None: all the room the context leaves),
        within the server's cap and the context. A streamed request's outputs are its deltas."""
        max_model_len = self.limits.max_model_len
        if request.n > self.limits.max_num_seqs:
            raise bad_request(f"n={request.n} is above this server's max_num_seqs={self.limits.max_num_seqs}", "n")
        try:
            check_prompt_length(prompt_len, max_model_len)
            room = max_model_len - prompt_len
            if max_tokens is None:
                max_tokens = min(default_max_tokens or room, room, self.max_tokens_cap or room)
            if self.max_tokens_cap is not None and max_tokens > self.max_tokens_cap:
                raise bad_request(f"{name}={max_tokens} is above this server's cap of {self.max_tokens_cap}", name,
                                  cause="too_long")
            if prompt_len + max_tokens > max_model_len:
                raise bad_request(f"this model's maximum context length is {max_model_len} tokens, but "
                                  f"{prompt_len + max_tokens} were asked for: {prompt_len} in the prompt and {name}="
                                  f"{max_tokens}; shorten either", name, cause="too_long",
                                  code="context_length_exceeded")
            return SamplingParams(
                n=request.n, temperature=1.0 if request.temperature is None else request.temperature,
                top_p=1.0 if request.top_p is None else request.top_p,
                top_k=-1 if request.top_k is None else request.top_k,
                min_p=0.0 if request.min_p is None else request.min_p,
                repetition_penalty=1.0 if request.repetition_penalty is None else request.repetition_penalty,
                presence_penalty=request.presence_penalty, frequency_penalty=request.frequency_penalty,
                seed=request.seed, max_tokens=max_tokens, min_tokens=request.min_tokens, stop=request.stop,
                stop_token_ids=request.stop_token_ids, ignore_eos=request.ignore_eos, logprobs=logprobs,
                output_kind=RequestOutputKind.DELTA if request.stream else RequestOutputKind.FINAL_ONLY,
                structured_outputs=structured_outputs)
        except RequestError as e:
            raise refused(e) from e

    def _timeout(self, request: SamplingRequest) -> float | None:
        if request.request_timeout is None:
            return self.request_timeout
        if self.request_timeout is not None and request.request_timeout > self.request_timeout:
            raise bad_request(f"request_timeout={request.request_timeout} is above this server's cap of "
                              f"{self.request_timeout} s", "request_timeout")
        return request.request_timeout

    async def _submit(self, response_id: str, prompts: list[Prompt], params: list[SamplingParams],
                      request: SamplingRequest, lora: LoRARequest | None = None) -> list[RequestStream]:
        """One engine request per prompt, each with the LoRA adapter `lora`; if one is refused, the others
        are aborted."""
        if request.stream_options is not None and not request.stream:
            raise bad_request("stream_options needs stream set to true", "stream_options")
        timeout = self._timeout(request)
        admission = None if self.guard is None else self.guard.admit(request, [len(p.token_ids) for p in prompts])
        streams = []
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params)):
                stream = await self.engine.add_request(prompt.token_ids, p, f"{response_id}-{i}", timeout=timeout,
                                                       priority=request.priority, lora_request=lora)
                streams.append(stream if admission is None else admission.watch(stream, len(prompt.token_ids)))
        except BaseException as e:
            for stream in streams:
                stream.close()
            if admission is not None:
                admission.release()
            if isinstance(e, RequestError):
                raise refused(e) from e
            raise
        return streams
