"""slo.py's parts alone: the service rate admission predicts from, and which objectives a request missed."""

import math

import pytest

from paged_jax.serving.slo import Objective, ServiceRate


def test_the_service_rate_counts_finishes_over_the_time_the_engine_was_full():
    rate = ServiceRate(tau=10.0)
    rate.observe(0.0, 0, full=True)
    assert rate.per_second is None  # nothing finished yet
    rate.observe(2.0, 1, full=True)
    assert rate.per_second == pytest.approx(0.5)
    rate.observe(3.0, 1, full=False)  # the second counted over the full second before it
    decay = math.exp(-1 / 10)
    assert rate.per_second == pytest.approx((1 * decay + 1) / (2 * decay + 1))
    before = rate.per_second
    rate.observe(50.0, 3, full=True)  # idle time (not full) measures nothing
    assert rate.per_second == before


def test_objectives_missed():
    objective = Objective(ttft_ms=500, tpot_ms=50)
    assert objective.missed(0.4, 0.04) == []
    assert objective.missed(0.6, 0.06) == ["ttft", "tpot"]
    assert objective.missed(0.4, None) == []  # a single token has no time per output token
    assert Objective().missed(100.0, 100.0) == []
    with pytest.raises(ValueError):
        Objective(ttft_ms=0)
