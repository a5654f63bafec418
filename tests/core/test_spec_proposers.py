"""The proposers of speculative decoding against definitions written out the slow, obvious way."""

import collections
import math
import random

import numpy as np
import pytest

from paged_jax.spec_decode.ngram import propose_ngram
from paged_jax.spec_decode.suffix import SEPARATOR, SuffixOptions, SuffixProposer, draft


def ngram_by_definition(tokens, k, min_n, max_n):
    """Longest n in [min_n, max_n], latest earlier end on ties, by comparing lists."""
    L = len(tokens)
    for n in range(max_n, min_n - 1, -1):
        if n > L - 1:
            continue
        suffix = tokens[L - n :]
        ends = [i for i in range(n - 1, L - 1) if tokens[i - n + 1 : i + 1] == suffix]
        if ends:
            return tokens[ends[-1] + 1 : ends[-1] + 1 + k]
    return []


@pytest.mark.parametrize("vocab", [2, 3, 8])
def test_ngram_matches_its_definition_on_random_texts(vocab):
    rng = random.Random(vocab)
    for _ in range(400):
        tokens = [rng.randrange(vocab) for _ in range(rng.randrange(0, 40))]
        k, lo = rng.randrange(1, 6), rng.randrange(1, 4)
        hi = lo + rng.randrange(0, 4)
        got = propose_ngram(np.asarray(tokens, np.int64), k, lo, hi).tolist()
        assert got == ngram_by_definition(tokens, k, lo, hi), (tokens, k, lo, hi)


def test_ngram_proposes_what_followed_the_repeated_phrase():
    text = [5, 1, 2, 3, 4, 9, 9, 7, 1, 2, 3]
    assert propose_ngram(np.asarray(text), 3, 2, 4).tolist() == [4, 9, 9]
    assert propose_ngram(np.asarray(text), 3, 4, 5).tolist() == []  # no 4-token match
    assert propose_ngram(np.asarray([1, 2, 3]), 3, 1, 3).tolist() == []


def draft_by_definition(texts, context, k, max_match, min_token_prob, max_spec_factor):
    """Suffix decoding's draft over lists: the longest suffix of context (at most max_match tokens)
    that some text holds with a token after it; the most frequent of those next tokens (ties to the
    earliest occurrence's), while the product of their shares stays at least min_token_prob, at most
    k and ceil(factor x match) tokens; the occurrences going on with it are followed, and where none
    is left, context + drafts is matched again."""
    def occurrences(suffix):
        for m in range(min(max_match, len(suffix)), 0, -1):
            found = [(t, i) for t, text in enumerate(texts) for i in range(m - 1, len(text) - 1)
                     if text[i - m + 1 : i + 1] == suffix[len(suffix) - m :]]
            if found:
                return found, m
        return [], 0

    found, m = occurrences(context)
    out, prob, score = [], 1.0, 0.0
    while found and len(out) < min(k, math.ceil(max_spec_factor * m)):
        after = [texts[t][i + 1] for t, i in found]
        counts = collections.Counter(after)
        best = max(counts.values())
        token = next(a for a in after if counts[a] == best)
        prob *= best / len(after)
        if prob < min_token_prob:
            break
        out.append(token)
        score += prob
        found = [(t, i + 1) for t, i in found if texts[t][i + 1] == token and i + 2 < len(texts[t])]
        if not found:
            found, _ = occurrences(context + out)
    return out, score


def test_suffix_drafts_the_frequent_continuation_and_as_far_as_the_match_allows():
    proposer = SuffixProposer(SuffixOptions(depth=8, min_token_prob=0.1, max_spec_factor=1.0))
    text = [1, 2, 3, 4, 5, 6, 7, 8, 0, 1, 2, 3]
    # The match "1 2 3" (3 tokens) allows 3 drafts, of what followed it: 4 5 6.
    assert proposer.propose(text, k=8) == [4, 5, 6]
    # Repeated whole, a longer match ("6 7 8 9 1 2 3") drafts as far as k.
    assert proposer.propose([1, 2, 3, 4, 5, 6, 7, 8, 9] * 3 + [1, 2, 3], k=5) == [4, 5, 6, 7, 8]
    # A one-token match drafts one token.
    assert proposer.propose([7, 1, 9, 1], k=5) == [9]


def test_suffix_shares_finished_outputs_and_stays_bounded():
    proposer = SuffixProposer(SuffixOptions(depth=6, max_cached_requests=2))
    output = [10, 11, 12, 13, 14, 15, 16]
    proposer.finish(output)
    # Another request whose own tokens never had the phrase finds it among finished outputs.
    assert proposer.propose([3, 3, 10, 11, 12], k=3) == [13, 14, 15]
    for t in range(2, 40):
        proposer.finish([t, t + 1, t + 2])
    assert proposer.cached.tolist() == [38, 39, 40, SEPARATOR, 39, 40, 41, SEPARATOR]
    assert proposer.propose([3, 3, 10, 11, 12], k=3) == []  # the first output has left
    # An output's end is not followed into the next one's start.
    assert proposer.propose([5, 40], k=3) == [41]


def test_suffix_stops_where_the_continuation_is_uncertain():
    proposer = SuffixProposer(SuffixOptions(depth=8, min_token_prob=0.3))
    # After "1 2" came 3, 4, 5 and 6 once each: no continuation reaches a chance of 0.3.
    assert proposer.propose([1, 2, 3, 1, 2, 4, 1, 2, 5, 1, 2, 6, 1, 2], k=4) == []


def test_suffix_chances_ignore_occurrences_that_end_the_text():
    # "1 2 3" occurs twice, but the second is the context itself, which says nothing of what follows:
    # the one continuation seen has a chance of 1, not 1/2, and passes a threshold of 0.6.
    proposer = SuffixProposer(SuffixOptions(depth=8, min_token_prob=0.6))
    assert proposer.propose([1, 2, 3, 4, 5, 0, 1, 2, 3], k=3) == [4, 5, 0]


@pytest.mark.parametrize("vocab", [2, 5])
def test_suffix_drafts_as_defined_from_its_own_text_and_the_cached_outputs(vocab):
    rng = random.Random(vocab)
    for _ in range(300):
        texts = [[rng.randrange(vocab) for _ in range(rng.randrange(1, 30))] for _ in range(rng.randrange(0, 4))]
        tokens = [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))]
        k, depth = rng.randrange(1, 8), rng.choice([3, 6, 60])
        prob, factor = rng.choice([0.0, 0.1, 0.3]), rng.choice([0.5, 1.0, 4.0])
        proposer = SuffixProposer(SuffixOptions(depth, max_cached_requests=len(texts) or 1, min_token_prob=prob,
                                                max_spec_factor=factor))
        for t in texts:
            proposer.finish(t)
        own = draft(np.asarray(tokens), np.asarray(tokens), k, depth - 1, prob, factor)
        shared = draft(proposer.cached, np.asarray(tokens), k, depth - 1, prob, factor)
        assert own[0] == draft_by_definition([tokens], tokens, k, depth - 1, prob, factor)[0], (tokens, k)
        assert own[1] == pytest.approx(draft_by_definition([tokens], tokens, k, depth - 1, prob, factor)[1])
        expected = draft_by_definition(texts, tokens, k, depth - 1, prob, factor)
        assert shared[0] == expected[0] and shared[1] == pytest.approx(expected[1]), (texts, tokens, k)
        assert proposer.propose(tokens, k) == max(own, shared, key=lambda d: d[1])[0]
