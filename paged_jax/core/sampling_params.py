"""What a request asks of the sampler: vLLM's `SamplingParams`, names, defaults and checks."""

import dataclasses
import enum
import json
from collections.abc import Mapping, Sequence

import numpy as np

from paged_jax.core.errors import RequestError

# Temperatures below this are greedy, as in vLLM: dividing by them would overflow float32 logits.
SAMPLING_EPS = 1e-5
# Most top logprobs a request may ask for (vLLM's default `max_logprobs`); the sampler always
# computes this many when any row asks, so the compiled shape does not depend on the request.
MAX_LOGPROBS = 20


class RequestOutputKind(enum.Enum):
    """What each RequestOutput of a request holds (vLLM's names)."""

    CUMULATIVE = 0  # everything so far: the whole text, every token id
    DELTA = 1  # only what is new since the request's previous output
    FINAL_ONLY = 2  # one output, once the request has finished


@dataclasses.dataclass(frozen=True, slots=True)
class StructuredOutputsParams:
    """A constraint on what a request generates, exactly one of (vLLM's names):

    json: a JSON schema (a dict, or its JSON text) the output must validate against;
    regex: a regular expression (Rust's `regex` syntax) the whole output must match;
    choice: the output is one of these strings;
    grammar: a context-free grammar, in Lark or GBNF syntax (llguidance's);
    json_object: any JSON object.

    JSON is generated compact (", " and ": " between items, no other whitespace) unless
    whitespace_pattern gives a regex for the whitespace allowed between tokens: free whitespace lets a
    small model write newlines until max_tokens. `choice` is stored as a tuple.
    """

    json: str | Mapping | None = None
    regex: str | None = None
    choice: Sequence[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    whitespace_pattern: str | None = None

    def __post_init__(self):
        given = [name for name in ("json", "regex", "choice", "grammar", "json_object") if getattr(self, name)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs takes exactly one of json, regex, choice, grammar and "
                             f"json_object, got {given or 'none'}")
        if isinstance(self.json, str):
            try:
                json.loads(self.json)
            except ValueError as e:
                raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
        elif self.json is not None and not isinstance(self.json, Mapping):
            _bad("structured_outputs.json", self.json, "must be a JSON schema: an object or its JSON text")
        if self.choice is not None:
            if isinstance(self.choice, str) or not all(isinstance(c, str) and c for c in self.choice):
                _bad("structured_outputs.choice", self.choice, "must be a list of non-empty strings")
            object.__setattr__(self, "choice", tuple(self.choice))
        for name in ("regex", "grammar", "whitespace_pattern"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                _bad(f"structured_outputs.{name}", getattr(self, name), "must be a string")


@dataclasses.dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick each generated token of one request, and when to stop.

    top_k -1 or 0 turns top-k off (both spellings are vLLM's; 0 is stored as -1). `stop` is stored as
    a tuple of strings and `stop_token_ids` as a tuple of ints. With `use_beam_search` the beam width
    is `n` and the search is deterministic, so temperature must be 0 and top_p/top_k/min_p off.
    `seed` is any int; without one the engine draws a seed for the request. `output_kind` says what
    each of the request's outputs holds (RequestOutputKind). `structured_outputs` constrains the output
    to a schema, regex, choice or grammar (not with beam search).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop: str | Sequence[str] | None = None
    stop_token_ids: Sequence[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    use_beam_search: bool = False
    length_penalty: float = 1.0
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self):
        stop = () if self.stop is None else (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        # Frozen: the normalised fields are set once here, during construction.
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        if self.top_k == 0:
            object.__setattr__(self, "top_k", -1)
        self._check_ranges()
        if self.use_beam_search:
            self._check_beam_search()
        else:
            self._check_sampling()

    @property
    def greedy(self) -> bool:
        """Whether each token is the argmax of the (penalised) logits."""
        return self.temperature < SAMPLING_EPS

    @property
    def uses_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def _check_ranges(self):
        # The sampler computes in float32: an infinite or NaN factor there turns logits into NaNs.
        for name in ("temperature", "repetition_penalty", "length_penalty"):
            if not abs(getattr(self, name)) <= _FLOAT32_MAX:
                _bad(name, getattr(self, name), "must be a finite number within float32's range")
        if self.n < 1:
            _bad("n", self.n, "must be at least 1")
        if self.temperature < 0:
            _bad("temperature", self.temperature, "must be non-negative")
        if not 0 < self.top_p <= 1:
            _bad("top_p", self.top_p, "must be in (0, 1]")
        if self.top_k < -1:
            _bad("top_k", self.top_k, "must be -1 or 0 (off) or at least 1")
        if not 0 <= self.min_p <= 1:
            _bad("min_p", self.min_p, "must be in [0, 1]")
        if self.repetition_penalty <= 0:
            _bad("repetition_penalty", self.repetition_penalty, "must be positive")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                _bad(name, getattr(self, name), "must be in [-2, 2]")
        if self.max_tokens < 1:
            _bad("max_tokens", self.max_tokens, "must be at least 1")
        if not 0 <= self.min_tokens <= self.max_tokens:
            _bad("min_tokens", self.min_tokens, f"must be in [0, max_tokens={self.max_tokens}]")
        if "" in self.stop:
            _bad("stop", self.stop, "must not contain an empty string")
        if any(t < 0 for t in self.stop_token_ids):
            _bad("stop_token_ids", self.stop_token_ids, "must be non-negative token ids")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            _bad("logprobs", self.logprobs, f"must be None or in [0, {MAX_LOGPROBS}]")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            _bad("structured_outputs", self.structured_outputs, "must be a StructuredOutputsParams")

    def _check_beam_search(self):
        if self.structured_outputs is not None:
            # Beams rank the model's own top proposals, which a constraint would have to re-rank.
            _bad("structured_outputs", self.structured_outputs, "is not supported with use_beam_search")
        if self.n < 2:
            _bad("n", self.n, "is the beam width and must be at least 2 with use_beam_search")
        if not self.greedy:
            _bad("temperature", self.temperature, "must be 0 with use_beam_search")
        for name, off in (("top_p", 1.0), ("top_k", -1), ("min_p", 0.0)):
            if getattr(self, name) != off:
                _bad(name, getattr(self, name), f"must be {off} (off) with use_beam_search")

    def _check_sampling(self):
        if self.length_penalty != 1.0:
            _bad("length_penalty", self.length_penalty, "only applies with use_beam_search; leave it 1.0")
        # n greedy samples would be n copies of one sequence (vLLM refuses them too).
        if self.greedy and self.n > 1:
            _bad("n", self.n, "must be 1 with greedy sampling (temperature 0)")


_FLOAT32_MAX = float(np.finfo(np.float32).max)


def _bad(name: str, value, why: str):
    raise RequestError(f"{name} {why}, got {value!r}", name)
