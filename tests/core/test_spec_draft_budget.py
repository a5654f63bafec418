"""The draft budget's sharing against its definition (the drafts kept maximise the expected accepted
tokens, found by trying every split), and the chance of acceptance it shares by."""

import itertools
import random

import pytest

from paged_jax.spec_decode.draft_budget import Chance, share


def expected_accepted(kept, rates):
    """Draft j of a sequence is accepted with chance rate ** (j + 1): all before it must be too."""
    return sum(r ** (j + 1) for n, r in zip(kept, rates) for j in range(n))


@pytest.mark.parametrize("seed", range(6))
def test_share_keeps_the_drafts_likeliest_to_be_accepted(seed):
    rng = random.Random(seed)
    for _ in range(60):
        count = rng.randint(1, 4)
        lengths = [rng.randint(0, 5) for _ in range(count)]
        rates = [rng.choice([0.0, 0.3, 0.5, 0.75, 0.9, rng.random()]) for _ in range(count)]
        budget = rng.randint(1, 12)
        kept = share(lengths, rates, budget)
        assert all(0 <= k <= n for k, n in zip(kept, lengths)) and sum(kept) == min(budget, sum(lengths))
        best = max(expected_accepted(split, rates) for split in itertools.product(*(range(n + 1) for n in lengths))
                   if sum(split) <= budget)
        assert expected_accepted(kept, rates) == pytest.approx(best)


def test_share_takes_turns_between_equals_and_gives_unused_shares_away():
    assert share([5, 5, 5, 5], [0.8] * 4, 12) == [3, 3, 3, 3]
    assert share([5, 5, 5, 5], [0.8] * 4, 10) == [3, 3, 2, 2]
    # A sequence without a match leaves its share to the others, the surer first.
    assert share([0, 5, 5, 5], [0.8, 0.9, 0.6, 0.8], 12) == [0, 5, 2, 5]
    assert share([2, 1], [0.5, 0.5], 12) == [2, 1]


def test_chance_follows_the_last_verify_steps():
    chance = Chance()
    start = chance.rate
    for _ in range(4):
        chance.update(5, 5)  # all accepted: no rejection
    assert chance.rate > 0.95 > start
    for _ in range(8):
        chance.update(5, 0)  # rejected at the first draft
    assert chance.rate < 0.3
