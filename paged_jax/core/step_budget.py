"""A step's token budget: max_num_batched_tokens in all, and while sequences decode, the share of it
that prompts may take (long_prefill_token_threshold), so that a decode waits for a short step rather
than for a whole long prompt (scheduler.py spends it).
"""

from paged_jax.core.config import EngineConfig
from paged_jax.core.sequence import Sequence

# Prompt tokens a step may carry per decoding sequence, whatever long_prefill_token_threshold says:
# under load, prompts are then admitted as fast as requests finish for workloads whose prompts are up
# to three times as long as their outputs (W1's are 2.4 times), so the batch stays full.
PROMPT_TOKENS_PER_DECODE = 3
# More requests waiting than this: they come faster than they are served, and their first tokens wait
# on the queue more than on any step. The cap on prompt tokens lifts, and steps take all the prompt
# tokens they can (throughput first) until the backlog is gone.
BACKLOG = 8


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
    """What is left of a step's tokens, and of the share of them prompts may take (None: all)."""

    def __init__(self, tokens: int, prompt_tokens: int | None):
        self.tokens, self.prompt_tokens = tokens, prompt_tokens

    def for_prompt(self) -> int:
        return self.tokens if self.prompt_tokens is None else min(self.tokens, self.prompt_tokens)

    def spend(self, seq: Sequence, num_new: int) -> None:
        """seq was given num_new tokens; whether they count as prompt tokens is told by what it had left
        (more than one token: a prompt, or a preempted sequence computing its tokens again)."""
        self.tokens -= num_new
        if self.prompt_tokens is not None and seq.num_computable_tokens - seq.num_computed_tokens > 1:
            self.prompt_tokens -= num_new
