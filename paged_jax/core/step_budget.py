"""A step's token budget: max_num_batched_tokens in all, and while sequences decode, the share of it
that prompts may take (long_prefill_token_threshold), so that a decode waits for a short step rather
than for a whole long prompt (scheduler.py spends it), without cutting a prompt's last few tokens into
a step of their own or holding a first token back for another prompt's tokens; and a prompt chunk cut
to fill its step's token bucket rather than pad it (fit_bucket).
"""

import bisect
from collections.abc import Sequence as Buckets

from paged_jax.core.config import EngineConfig
from paged_jax.core.scheduler_output import ScheduledSeq
from paged_jax.core.sequence import Sequence

# Prompt tokens a step may carry per decoding sequence, whatever long_prefill_token_threshold says:
# under load, prompts are then admitted as fast as requests finish for workloads whose prompts are up
# to three times as long as their outputs (W1's are 2.4 times), so the batch stays full.
PROMPT_TOKENS_PER_DECODE = 3
# More requests waiting than this: they come faster than they are served, and their first tokens wait
# on the queue more than on any step. The cap on prompt tokens lifts, and steps take all the prompt
# tokens they can (throughput first) until the backlog is gone. 2, not more: W1 served at 4 requests/s
# (past what a 2-core CPU serves) with 2 against 8, Intel Xeon, 4 runs each: TTFT median 562-593 ms
# against 609-822, p99 2,182-2,391 against 2,743-3,389, ITL p99 904-962 against 512-571 (vLLM's:
# 1,370-1,789); at 1 and 2 requests/s, where queues stay short, no different.
BACKLOG = 2
# What a step costs beyond its tokens, in tokens: a CPU step takes about 8 ms plus 0.6 ms a token on
# the 2-core machines this was measured on (scripts/measure_step_time.py).
STEP_OVERHEAD_TOKENS = 14


def prompt_cap(config: EngineConfig, num_decoding: int, num_waiting: int) -> int | None:
    """The most prompt tokens a step may carry beside num_decoding decoding sequences: what fills the
    step up to long_prefill_token_threshold tokens, and at least PROMPT_TOKENS_PER_DECODE per decode.
    None (no cap beyond the budget) when nothing decodes, prompts cannot be chunked, the threshold is
    0, or more than BACKLOG requests wait."""
    threshold = config.long_prefill_token_threshold
    if not threshold or not config.enable_chunked_prefill or num_waiting > BACKLOG or not num_decoding:
        return None
    return max(threshold - num_decoding, PROMPT_TOKENS_PER_DECODE * num_decoding)


class StepBudget:
    """What is left of a step's tokens, and of the share of them prompts may take (None: all); how
    many sequences decode in the step, and how many prompts end in it so far (each sampling its first
    token when the step ends)."""

    def __init__(self, tokens: int, prompt_tokens: int | None, decodes: int):
        self.tokens, self.prompt_tokens, self.decodes = tokens, prompt_tokens, decodes
        self.first_tokens = 0

    def for_prompt(self, remaining: int) -> int:
        """Tokens a prompt with `remaining` left to compute may take now. Past the prompt share it still
        takes them all when the overshoot is less than the step of its own that its last few tokens
        would cost its first token (the decodes would compute them in that step instead: cutting them
        off shortens this step but spares nobody anything)."""
        if self.prompt_tokens is None:
            return min(self.tokens, remaining)
        allowed = max(0, min(self.tokens, self.prompt_tokens))  # an overshoot leaves the share below 0
        if remaining - allowed <= self.own_step_tokens() and remaining <= self.tokens:
            return remaining
        return allowed

    def own_step_tokens(self) -> int:
        """In tokens, the least that a step of its own costs a prompt's first token: the step's overhead
        and the decodes that run in it."""
        return STEP_OVERHEAD_TOKENS + self.decodes

    def delays_first_tokens(self, num_new: int) -> bool:
        """Whether a prompt chunk of num_new tokens, joining a step in which prompts end, should wait for
        the next step instead: while sequences decode (prompts capped), when what it adds to their first
        tokens' waits is more than what it saves itself by not waiting for a step of its own. The
        decodes wait for its tokens in this step or the next alike."""
        return self.prompt_tokens is not None and self.first_tokens * num_new > self.own_step_tokens()

    def spend(self, seq: Sequence, num_new: int) -> None:
        """seq was given num_new tokens; whether they count as prompt tokens is told by what it had left
        (more than one token: a prompt, or a preempted sequence computing its tokens again)."""
        self.tokens -= num_new
        if seq.num_computable_tokens - seq.num_computed_tokens > 1:
            if self.prompt_tokens is not None:
                self.prompt_tokens -= num_new
            self.first_tokens += num_new > 1 and seq.num_computed_tokens + num_new == seq.num_tokens


def fit_bucket(num_new: int, before: int, after: int, buckets: Buckets[int], then: int | None = None) -> int:
    """A prompt chunk of num_new tokens, cut so that its step (before + num_new + after tokens) fills
    the token bucket below rather than padding up to the one above (buckets: the step sizes T,
    ascending; buckets.py). A padded token costs as much as a real one: a prompt of 270 tokens alone,
    padded to 384, is quicker as 256 now and 14 in a step of 16.

    The cut is made when it moves fewer tokens to a later step than it saves in padding, and leaves the
    chunk at least one token. then: for a chunk that ends its prompt, the tokens the next step holds
    anyway (its decodes); the cut makes the first token wait for that step, so the padding saved must
    outweigh the whole step, the moved tokens included."""
    total = before + num_new + after
    i = bisect.bisect_left(buckets, total)
    if i == 0 or i == len(buckets) or buckets[i] == total:
        return num_new
    excess, padding = total - buckets[i - 1], buckets[i] - total
    if then is not None:
        next_step = buckets[min(bisect.bisect_left(buckets, then + excess), len(buckets) - 1)]
        if padding <= STEP_OVERHEAD_TOKENS + next_step:
            return num_new
    return num_new - excess if excess < min(num_new, padding) else num_new


def num_partial_prefills(scheduled: list[ScheduledSeq], running: list[Sequence]) -> int:
    """Running prompts that will be part-way through their prefill after this step, as scheduled so far."""
    new = {id(s.seq): s.num_new_tokens for s in scheduled}
    return sum(0 < seq.num_computed_tokens + new[id(seq)] < seq.num_computable_tokens if id(seq) in new
               else 0 < seq.num_computed_tokens < seq.num_computable_tokens - 1 for seq in running)
