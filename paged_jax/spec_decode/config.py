"""What the user asks of speculative decoding, under vLLM's names (its SpeculativeConfig's keys)."""

import dataclasses
import json

METHODS = ("ngram", "suffix")


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 5  # k: the most drafts a sequence has verified in one step
    # n-gram: the context's suffix looked up is between these lengths, the longest found wins.
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    # No drafts while this many sequences or more run (None: never off); vLLM's name. Measured with
    # bench_spec.py (docs/engine.md): on two cores, SmolLM2 and k = 5, drafting won at 4 sequences
    # and lost at 8, where a verify step's k + 1 tokens a sequence outweigh what it accepts.
    disable_by_batch_size: int | None = 6
    # The most draft tokens one step verifies, shared by its sequences' draft positions likeliest to be
    # accepted (spec_decode/draft_budget.py; None: the engine's choice for its device, DRAFT_BUDGETS in
    # engine_parts.py). Not vLLM's: its GPUs verify a few more rows a step for nothing, and a CPU does not.
    max_draft_tokens_per_step: int | None = None
    # A sequence stops drafting once, over at least `acceptance_window` drafts, fewer than this share
    # were accepted; it tries again after as many output tokens (0: never stops).
    min_acceptance_rate: float = 0.1
    acceptance_window: int = 32
    # Suffix decoding (vLLM's names): the depth (a match is at most depth - 1 tokens), the finished
    # outputs held, the least estimated chance of a draft token, and drafts per matched token. vLLM's
    # factor is 1 (with k at the depth by default); at k = 5 a short match just after an edit then drafts
    # one or two tokens where prompt lookup drafts five, and on replayed greedy outputs (spec_replay.py) 2
    # took fewer steps than 1 and than prompt lookup on every workload of bench_spec.py. The least chance
    # is 0.5 where vLLM's is 0.1: on the same replays (8 requests a workload) it verified 2 to 5% fewer
    # tokens per output token on rewrite, W1 and quote (as many on edit) for at most 1.5% more steps, and
    # a draft token's compute is not free on a CPU, where a step of 4 sequences and their drafts is bound
    # by it.
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 1000
    suffix_decoding_min_token_prob: float = 0.5
    suffix_decoding_max_spec_factor: float = 2.0

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"speculative method must be one of {METHODS}, got {self.method!r}")
        if self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                             f"{self.prompt_lookup_min} and {self.prompt_lookup_max}")
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ValueError(f"disable_by_batch_size must be >= 1, got {self.disable_by_batch_size}")
        if self.max_draft_tokens_per_step is not None and self.max_draft_tokens_per_step < 1:
            raise ValueError(f"max_draft_tokens_per_step must be >= 1, got {self.max_draft_tokens_per_step}")
        if self.suffix_decoding_max_tree_depth < 2:
            raise ValueError("suffix_decoding_max_tree_depth must be >= 2")

    @classmethod
    def of(cls, value: "SpeculativeConfig | dict | str | None") -> "SpeculativeConfig | None":
        """From a dict of vLLM's keys or its JSON (the server's --speculative-config); unknown keys refused."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            value = json.loads(value)
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(value) - names
        if unknown:
            raise ValueError(f"unknown speculative_config keys {sorted(unknown)}; known: {sorted(names)}")
        return cls(**value)
