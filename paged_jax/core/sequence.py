"""Host-side state of one sequence as the scheduler moves it through the engine."""

import dataclasses
import enum
from typing import TYPE_CHECKING

from paged_jax.core.lora_request import LoRARequest
from paged_jax.core.prefix_cache import ROOT_HASH
from paged_jax.core.sampling_params import SamplingParams

if TYPE_CHECKING:
    from paged_jax.core.structured_output import Guide


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclasses.dataclass(eq=False)
class Sequence:
    """One sample of one request. token_ids holds the prompt followed by what was generated."""

    seq_id: int
    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    seed: int
    arrival_time: float
    index: int = 0  # which of the request's n samples
    # Under the "priority" policy a lower value runs first (vLLM's); 0 under the others.
    priority: int = 0
    status: Status = Status.WAITING
    block_ids: list[int] = dataclasses.field(default_factory=list)
    # Where the model's layers form several KV groups (models/kv_groups.py): the block lists of the
    # groups past the first, as long as block_ids, NULL_BLOCK where a sliding group gave a block back
    # (window_blocks.py). Empty for a model of one group.
    group_block_ids: list[list[int]] = dataclasses.field(default_factory=list)
    num_computed_tokens: int = 0
    # Full blocks already named in the prefix cache, so each is inserted once.
    num_cached_blocks: int = 0
    # The names of its full blocks so far (prefix_cache.block_hashes), each computed once.
    block_hashes: list[int] = dataclasses.field(default_factory=list)
    # Tokens a dispatched step has sampled that the host has not read yet (asynchronous scheduling:
    # the engine runs one step ahead); the scheduler counts them, the next step reads the last of them
    # on the device, at row `sample_row` of the step that sampled it.
    num_pending: int = 0
    sample_row: int = -1
    # Speculative decoding (spec_decode/): tokens proposed to follow token_ids, computed in the next
    # step and verified there; counted in num_tokens (the scheduler gives them room), never in
    # token_ids (nothing caches or outputs a draft). Replaced whole, never changed in place.
    draft_ids: list[int] = dataclasses.field(default_factory=list)
    # Prompt tokens whose KV came from the prefix cache at admission.
    num_prefix_hit_tokens: int = 0
    # A request with n > 1 computes its prompt but the last token once, then forks into n samples.
    forks: int = 1
    # KV of a sequence preempted by swapping: host copies of its blocks, [layers][k|v] arrays.
    swapped_kv: object = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[dict[int, float]] = dataclasses.field(default_factory=list)
    cumulative_logprob: float = 0.0
    first_token_time: float | None = None
    finish_time: float | None = None
    num_preemptions: int = 0
    # Beam search: this beam's proposals (token, logprob) for its next token, awaiting selection.
    beam_candidates: list[tuple[int, float]] | None = None
    # Structured outputs: the matcher of the sequence's constraint, advanced with each output token.
    guide: "Guide | None" = None
    # The LoRA adapter it runs with (None: the base model), and the device slot holding it while it runs
    # (adapters.py; 0: none).
    lora: LoRARequest | None = None
    lora_slot: int = 0

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        """Output tokens the host has read (pending ones not counted)."""
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_tokens(self) -> int:
        """Tokens of the sequence as the scheduler sees it: those read, those still pending, its drafts."""
        return len(self.token_ids) + self.num_pending + len(self.draft_ids)

    @property
    def ends_when_read(self) -> bool:
        """Whether a pending token will end it by length (max_tokens), so no step needs to follow."""
        return self.num_pending > 0 and self.num_output_tokens + self.num_pending >= self.params.max_tokens

    @property
    def num_computable_tokens(self) -> int:
        """Tokens computed before the sequence samples: all of them, but for a parent of n samples
        all but the last, which each sample computes for itself once the parent forks."""
        return self.num_tokens - 1 if self.forks > 1 else self.num_tokens

    @property
    def prefix_root(self) -> int:
        """Where its blocks' names in the prefix cache chain from: its adapter's own root, if it has one."""
        return ROOT_HASH if self.lora is None else self.lora.prefix_root

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED
