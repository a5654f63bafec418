"""The checks a request passes before the engine takes it, each in this one place; a refusal is a
RequestError naming the field at fault. SamplingParams checks its own fields when it is built, and
policy.check_priority a priority; a front end adds only checks of its own (a server's token cap)."""

import dataclasses
from collections.abc import Sequence

from paged_jax.core.errors import RequestError
from paged_jax.core.policy import check_priority
from paged_jax.core.sampling_params import MAX_LOGPROBS, RequestOutputKind, SamplingParams


@dataclasses.dataclass(frozen=True)
class EngineLimits:
    """What a request must fit in: the engine's limits, for a front end to check or show."""

    max_model_len: int  # prompt and output tokens together
    vocab_size: int  # token ids are in [0, vocab_size)
    max_num_seqs: int  # sequences run at once
    scheduling_policy: str  # "priority" is the one that takes priorities other than 0


def check_token_ids(ids: Sequence[int], vocab_size: int, param: str) -> None:
    if not all(0 <= t < vocab_size for t in ids):
        raise RequestError(f"{param} must be token ids in [0, {vocab_size})", param)


def check_prompt_length(num_tokens: int, max_model_len: int) -> None:
    if num_tokens >= max_model_len:
        raise RequestError(f"prompt of {num_tokens} tokens is too long: max_model_len is {max_model_len} (the "
                           f"prompt and at least one generated token must fit)", "prompt",
                           code="context_length_exceeded")


def check_prompt(token_ids: Sequence[int], limits: EngineLimits) -> None:
    if not token_ids:
        raise RequestError("the prompt is empty", "prompt")
    check_token_ids(token_ids, limits.vocab_size, "prompt")
    check_prompt_length(len(token_ids), limits.max_model_len)


def check_request(prompt: str | Sequence[int], params: SamplingParams, priority: int, limits: EngineLimits, *,
                  has_tokenizer: bool) -> None:
    """Everything about a request but its prompt's token ids (check_prompt, once it is encoded)."""
    if not isinstance(params, SamplingParams):
        raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
    check_priority(limits.scheduling_policy, priority)
    if not has_tokenizer and isinstance(prompt, str):
        raise RequestError("this model has no tokenizer: give prompts as token ids", "prompt")
    if not has_tokenizer and params.stop:
        raise RequestError("this model has no tokenizer: stop strings cannot be matched; use stop_token_ids", "stop")
    if not has_tokenizer and params.structured_outputs is not None:
        raise RequestError("this model has no tokenizer, which structured outputs need", "structured_outputs")
    check_token_ids(params.stop_token_ids, limits.vocab_size, "stop_token_ids")
    if params.use_beam_search:
        if 2 * params.n > MAX_LOGPROBS:
            raise RequestError(f"beam width n={params.n} is above {MAX_LOGPROBS // 2}: each beam proposes 2n tokens "
                               f"from the sampler's top {MAX_LOGPROBS} logprobs", "n")
        if params.stop:
            raise RequestError("stop strings are not supported with beam search; use stop_token_ids", "stop")
        if params.output_kind is RequestOutputKind.DELTA:
            # Beams are reordered and replaced as the search goes: there is no "new since the last output".
            raise RequestError("output_kind DELTA is not supported with beam search", "output_kind")
