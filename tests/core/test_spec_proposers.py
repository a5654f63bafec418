"""The proposers of speculative decoding against definitions written out the slow, obvious way."""

import collections
import random

import numpy as np
import pytest

from paged_jax.spec_decode.ngram import propose_ngram
from paged_jax.spec_decode.suffix import SuffixOptions, SuffixProposer, SuffixTrie, own_draft


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


def substring_counts(texts, depth):
    counts = collections.Counter()
    for t in texts:
        for i in range(len(t)):
            for j in range(i + 1, min(len(t), i + depth) + 1):
                counts[tuple(t[i:j])] += 1
    return counts


def trie_counts(trie):
    out, stack = {}, [(trie.root, ())]
    while stack:
        node, path = stack.pop()
        for t, child in node.children.items():
            out[path + (t,)] = child.count
            stack.append((child, path + (t,)))
    return out


def test_trie_counts_every_substring_added_in_pieces_and_forgets_removed_texts():
    rng = random.Random(0)
    texts = [[rng.randrange(4) for _ in range(rng.randrange(1, 30))] for _ in range(6)]
    trie = SuffixTrie(depth=5)
    for t in texts:
        paths = [(trie.root, 0)]
        cut = len(t) // 2
        paths = trie.extend(paths, t[:cut])
        trie.extend(paths, t[cut:])  # in two pieces, as a running sequence's tokens come
    assert trie_counts(trie) == substring_counts(texts, 5)
    for t in texts[:4]:
        trie.extend([(trie.root, 0)], t, weight=-1)
    assert trie_counts(trie) == substring_counts(texts[4:], 5)
    assert trie.num_nodes == len(trie_counts(trie))


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
    assert trie_counts(proposer.shared) == substring_counts([[38, 39, 40], [39, 40, 41]], 6)
    assert proposer.propose([3, 3, 10, 11, 12], k=3) == []  # the first output has left


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
def test_suffix_own_draft_is_the_trie_draft_over_the_same_text(vocab):
    # A trie deeper than the text never cuts a path, so it drafts exactly what own_draft finds from
    # the occurrences (the same counts, ties to the earliest, the same matching again at the end).
    rng = random.Random(vocab)
    for _ in range(300):
        tokens = [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))]
        k = rng.randrange(1, 8)
        prob, factor = rng.choice([0.0, 0.1, 0.3]), rng.choice([0.5, 1.0, 4.0])
        trie = SuffixTrie(depth=60)
        trie.extend([(trie.root, 0)], tokens)
        expected = trie.draft(tokens, k, prob, factor)
        got = own_draft(np.asarray(tokens), k, trie.depth - 1, prob, factor)
        assert got[0] == expected[0] and got[1] == pytest.approx(expected[1]), (tokens, k, prob, factor)
