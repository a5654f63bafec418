"""How long a prompt token takes to prefill, known before the first request: what admission by SLO
(slo.py) predicts a cold replica's queue from, before any request has finished.

Right after the warm-up, the engine loop runs one probe (`probe`): a prompt that fills a step's token
budget, run to its first token, timed, its cached blocks dropped after. That gives the cost of a token
in a full step, every program already made, on this machine as loaded now. From then on `PrefillClock`
refines it from the steps the engine runs that are mostly prompt (at least half the probe's tokens):
seconds per token, a moving average over about `tau` such steps.
"""

import time

from paged_jax.core.sampling_params import SamplingParams


def probe(engine) -> tuple[float, int]:
    """(seconds, tokens) of one full prefill step of `engine` (an LLMEngine with nothing to run).

    The prompt repeats one token id; its blocks stay in the prefix cache only until the probe ends."""
    config = engine.config
    tokens = min(config.max_num_batched_tokens, engine.resolved.max_model_len - 1)
    engine.add_request([engine.limits.vocab_size - 1] * tokens, SamplingParams(max_tokens=1, temperature=0.0),
                       request_id="prefill-probe")
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    seconds = time.perf_counter() - start
    engine.blocks.reset_prefix_cache()
    return seconds, tokens


class PrefillClock:
    """Seconds per prompt token in a full step: the probe's, then a moving average over the steps seen.
    Fed on the engine loop's thread; `seconds_per_token` read anywhere (None until the first step)."""

    def __init__(self, tau: float = 8.0):
        self.tau = tau
        self.seconds_per_token: float | None = None
        self._full_step_tokens = 0  # the probe's: a step with half as many counts as a prefill

    def observe(self, step_time: float, num_tokens: int) -> None:
        if num_tokens <= 0 or num_tokens * 2 < self._full_step_tokens:
            return  # a step of decodes: its cost is per sequence, not per prompt token
        self._full_step_tokens = max(self._full_step_tokens, num_tokens)
        cost = step_time / num_tokens
        old = self.seconds_per_token
        self.seconds_per_token = cost if old is None else old + (cost - old) / self.tau
