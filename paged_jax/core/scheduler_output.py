"""What one scheduling decision hands the engine: the sequences a step computes and how many new
tokens each, the block copies to make first, and the sequences preempted or forked on the way."""

import dataclasses

from paged_jax.core.sequence import Sequence


@dataclasses.dataclass(frozen=True)
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int
    # Decode steps it may run in one dispatch, its blocks reserved for them (multi_step.py); 1 but for
    # a decoding sequence when the engine runs several.
    num_steps: int = 1

    @property
    def samples(self) -> bool:
        """Whether this step computes the sequence's last known token, so its next one is sampled."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


@dataclasses.dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq]
    # KV block copies (source, destination) to make before the step: copy-on-write of shared blocks.
    copies: list[tuple[int, int]]
    preempted: list[Sequence]
    # Samples created this step by forking a request with n > 1.
    forked: list[Sequence]

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)
