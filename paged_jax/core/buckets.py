"""Bucketing: the few padded shapes a step can take, all known from the engine's limits, so that each
is compiled before traffic (warmup.py) and nothing compiles after.

A step is two jitted calls (model_runner.py): the model over the step's flat batch of new tokens, then
the head (final norm, lm_head) and the sampler over the rows that sample. Their static sizes, and why
each is what it is:

- T, the batch's tokens, from MIN_TOKENS up to max_num_batched_tokens' bucket. The model's matmuls
  run on every padded token, so this one follows the traffic: a fine bucket (powers of two and the
  midpoints between them, a third of a step at most is padding rather than half of it) where Q does
  not multiply the shapes (the CPU and XLA kernels), powers of two for the Pallas kernel, whose every
  T brings one shape per Q below it, and whose GPU step is bound by its host work more than by T.
- attention rows (block-table rows, seq_lens): min(T, max_num_seqs). Every scheduled sequence has a
  token, so never more than T: derived from T, no size of its own; the kernels skip empty rows.
- block-table width: always max_blocks_per_seq, the longest context's blocks (a few KB a step); the
  kernels read a row's real blocks only (its seq_len).
- Q, the static bound on one sequence's new tokens: the Pallas kernel's grid needs it (bucketed); the
  XLA path reads only whether some row has more than one token (1 or T); the CPU kernel reads each
  row's length at run time (always T).
- S, the sampled rows: on the CPU the packed lm_head multiplies only the real ones
  (SamplingTensors.num_rows; most of a millisecond a row), but the rest of the head and the sampler
  pay for every row, so S is a fine bucket (powers of two and the midpoints between them) up to
  max_num_seqs. On a GPU a padded row costs next to nothing (the head reads its weights once for all
  rows) while each program costs seconds to compile (6.4 s for SmolLM2's head and sampler on an H100,
  docs/gpu.md), so S is a power of two there: 7 row counts up to 64, not 12. The model call hands the
  head a fixed max_num_seqs rows to take them from.

Id lists of the block pool's calls and of KV-block copies are padded to fixed widths too
(block_manager.py, model_runner.py).
"""

import dataclasses
from typing import NamedTuple

import numpy as np

MIN_TOKENS = 16  # T's floor: below it a step costs about the same (the weights' read dominates)
# Ids per block-pool call: a step's log goes in one call of the narrowest that holds it; a longer one
# (a burst of admissions) in several of the widest.
POOL_IDS = (64, 512, 4096)
# How each attention backend reads the static bound on a sequence's new tokens (default: "bucketed").
_QUERY_LEN = {"cpu": "unused", "xla": "decode_or_not"}


def bucket(n: int, minimum: int = 1) -> int:
    """The smallest power of two >= max(n, minimum)."""
    return 1 << (max(n, minimum) - 1).bit_length()


def fine_bucket(n: int) -> int:
    """The smallest of 1, 2, 3, 4, 6, 8, 12, 16, 24, ... (powers of two and 1.5 times them) >= n."""
    power = bucket(n)
    return power * 3 // 4 if power >= 4 and n <= power * 3 // 4 else power


def pad_ids(ids, width: int, fill: int) -> np.ndarray:
    """int32 [width]: ids, then `fill`."""
    out = np.full(width, fill, np.int32)
    out[: len(ids)] = ids
    return out


class StepShape(NamedTuple):
    """The padded sizes of one step's flat batch; each distinct value compiles the model call once."""

    num_tokens: int  # T: new tokens of every sequence, end to end
    num_seqs: int  # rows of the block table
    max_blocks_per_seq: int  # block-table width
    max_query_len: int  # Q: static bound on one sequence's new tokens


@dataclasses.dataclass(frozen=True)
class StepBuckets:
    """The shapes of an engine's steps, from its limits."""

    max_num_batched_tokens: int
    max_num_seqs: int
    max_blocks_per_seq: int
    attention_backend: str  # a concrete backend (kernels_pallas.BACKENDS, not "auto")
    max_drafts: int = 0  # speculative decoding's k: a sequence verifying k drafts samples k + 1 rows

    @property
    def num_head_rows(self) -> int:
        """Rows the model call hands the head: the most rows a step can sample."""
        return min(self.max_num_seqs * (1 + self.max_drafts), self.max_num_batched_tokens)

    @property
    def _fine(self) -> bool:
        """Whether T and S are fine buckets: on the CPU's kernels, where padding costs what real work
        does; not for the Pallas kernel (a GPU), where programs are few and padding nearly free."""
        return _QUERY_LEN.get(self.attention_backend, "bucketed") != "bucketed"

    def token_bucket(self, num_tokens: int) -> int:
        """T for a step of num_tokens new tokens."""
        n = max(num_tokens, MIN_TOKENS)
        return fine_bucket(n) if self._fine else bucket(n)

    def token_buckets(self) -> list[int]:
        top = self.token_bucket(self.max_num_batched_tokens)
        powers = [1 << k for k in range(MIN_TOKENS.bit_length() - 1, top.bit_length())]
        if self._fine:
            powers += [p * 3 // 2 for p in powers]
        return sorted(t for t in set(powers) if t <= top)

    def query_lens(self, num_tokens: int) -> list[int]:
        """Every Q a step of T = num_tokens can have: the first for decode-only steps."""
        mode = _QUERY_LEN.get(self.attention_backend, "bucketed")
        if mode == "unused":
            return [num_tokens]
        if mode == "decode_or_not":
            return [1, num_tokens]
        return [1] + [q for q in self.token_buckets() if q <= num_tokens]

    def shape(self, num_tokens: int, max_new_tokens: int) -> StepShape:
        """The shape of a step computing num_tokens new tokens, at most max_new_tokens of one sequence."""
        if num_tokens > self.max_num_batched_tokens:
            raise ValueError(f"a step of {num_tokens} tokens is over max_num_batched_tokens "
                             f"({self.max_num_batched_tokens})")
        T = self.token_bucket(num_tokens)
        options = self.query_lens(T)
        # The smallest bound that holds: 1 only for a decode-only step.
        Q = next((q for q in options if q >= max_new_tokens), T)
        return StepShape(T, min(T, self.max_num_seqs), self.max_blocks_per_seq, Q)

    def shapes(self) -> list[StepShape]:
        """Every shape `shape` can give, smallest first."""
        return [StepShape(T, min(T, self.max_num_seqs), self.max_blocks_per_seq, Q)
                for T in self.token_buckets() for Q in self.query_lens(T)]

    def sample_rows(self, num_seqs: int) -> int:
        """S, the sampler's rows for num_seqs sampled sequences."""
        if num_seqs > self.num_head_rows:
            raise ValueError(f"{num_seqs} sequences in a step, over max_num_seqs ({self.max_num_seqs})")
        return min((fine_bucket if self._fine else bucket)(num_seqs), self.num_head_rows)

    def all_sample_rows(self) -> list[int]:
        return sorted({self.sample_rows(n) for n in range(1, self.num_head_rows + 1)})
