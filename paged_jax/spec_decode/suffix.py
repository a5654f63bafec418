"""Suffix decoding (Oliaro et al., 2024; arctic-inference's "suffix" method), by searching the texts.

A draft starts at the occurrences of the context's longest suffix (at most `depth` - 1 tokens) that
a token follows, and follows the most frequent of those next tokens while the product of their
shares (the estimate of each draft token's chance) stays at least `min_token_prob`; its length is
also capped at `max_spec_factor` times the match's length, so a long, frequent match drafts far and
a short or rare one little or nothing. A share is a token's count over the occurrences that have a
next token: the occurrence that ends the text (the context's own) says nothing of what follows.
These are the counts a suffix trie of the texts holds at the matched node and its children.

Two texts are searched, the better draft (by its expected accepted tokens) kept: the sequence's own
prompt and output, and the outputs of the last `max_cached_requests` finished sequences, joined with
a separator no token equals (so no occurrence runs from one into the next); the oldest leaves once
more are held, so the cache's size is bounded. Searching is numpy over the texts, a few vectorised
passes per draft token: a trie would answer a proposal from a few nodes, but inserting a finished
output into one touches `depth` nodes per token, tens of milliseconds of Python for a few hundred
tokens (a decode step's worth on two cores, paid by the step in which a sequence finished), and
building one over a sequence's own prompt costs as much per thousand tokens. What a proposal costs
instead grows with the cache: one comparison over it (int32), about 0.1 ms per hundred thousand
cached tokens, a few hundred tokens for each of `max_cached_requests` outputs at most.
"""

import collections
import dataclasses

import numpy as np

SEPARATOR = -1  # between the cached outputs: no token's id


def _longest_match(text: np.ndarray, suffix: np.ndarray, max_len: int) -> tuple[np.ndarray, int]:
    """The ends i (ascending) of the longest suffix of `suffix` (at most max_len tokens) that occurs in
    text with a token after it (i < len(text) - 1, text[i + 1] no SEPARATOR), and its length; (empty,
    0) when none occurs."""
    if len(suffix) == 0 or len(text) < 2:
        return np.zeros(0, np.int64), 0
    ends = np.flatnonzero(text[:-1] == suffix[-1])  # the one pass over the whole text
    ends = ends[text[ends + 1] != SEPARATOR]
    m = 1 if len(ends) else 0
    for j in range(1, min(max_len, len(suffix))):
        back = ends - j
        ok = back >= 0
        ok[ok] = text[back[ok]] == suffix[-1 - j]
        if not ok.any():
            break
        ends, m = ends[ok], m + 1
    return ends, m


def draft(text: np.ndarray, context: np.ndarray, k: int, max_match: int, min_token_prob: float,
          max_spec_factor: float) -> tuple[list[int], float]:
    """text: int [N], the tokens searched (SEPARATOR between texts); context: int [L], the sequence's
    tokens (text itself for its own) -> (up to k drafts, their score: the sum of their chances).
    The tokens after the occurrences of the longest suffix are counted (ties to the earliest, as a
    trie's insertion order has it); the occurrences that go on with the drafted token are followed,
    and once none is left (all ran into a text's end), context + drafts is matched again."""
    ends, m = _longest_match(text, context, max_match)
    limit = min(k, int(np.ceil(max_spec_factor * m)))
    out, prob, score = [], 1.0, 0.0
    while len(ends) and len(out) < limit:
        after = text[ends + 1]
        if (after == after[0]).all():  # copying: one continuation (np.unique's sort is most of a draft's cost)
            token = after[0]
        else:
            values, first, counts = np.unique(after, return_index=True, return_counts=True)
            best = np.flatnonzero(counts == counts.max())
            token = values[best[np.argmin(first[best])]]
        agree = after == token
        prob *= agree.sum() / len(after)
        if prob < min_token_prob:
            break
        out.append(int(token))
        score += prob
        ends = ends[agree] + 1
        ends = ends[ends < len(text) - 1]
        ends = ends[text[ends + 1] != SEPARATOR]
        if not len(ends):  # every occurrence ran into its text's end: where do the drafts so far recur?
            ends, _ = _longest_match(text, np.concatenate([context, out]), max_match)
    return out, score


@dataclasses.dataclass(frozen=True)
class SuffixOptions:
    depth: int = 24  # arctic-inference's max_tree_depth
    max_cached_requests: int = 1000
    min_token_prob: float = 0.1
    max_spec_factor: float = 1.0


class SuffixProposer:
    """Drafts for running sequences from their own tokens and the finished outputs cached.

    `propose` takes a sequence's tokens as they stand (its own part needs no state), `finish` adds
    the sequence's output to the cache."""

    def __init__(self, options: SuffixOptions = SuffixOptions()):
        self.options = options
        self.cached = np.zeros(0, np.int32)  # the cached outputs, each followed by SEPARATOR
        self._lengths: collections.deque[int] = collections.deque()

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """tokens: the sequence's prompt then output -> up to k drafts."""
        o = self.options
        tokens = np.asarray(tokens, np.int32)
        own = draft(tokens, tokens, k, o.depth - 1, o.min_token_prob, o.max_spec_factor)
        if own[1] >= k:  # k drafts, each certain: the cache's can at best tie, and a tie keeps these
            return own[0]
        shared = draft(self.cached, tokens, k, o.depth - 1, o.min_token_prob, o.max_spec_factor)
        return max(own, shared, key=lambda d: d[1])[0]

    def finish(self, output: list[int]) -> None:
        """A sequence ended: its output joins the cache, the oldest cached one leaving if full."""
        if not output or self.options.max_cached_requests <= 0:
            return
        drop = self._lengths.popleft() + 1 if len(self._lengths) == self.options.max_cached_requests else 0
        self._lengths.append(len(output))
        self.cached = np.concatenate([self.cached[drop:], np.asarray(output, np.int32), np.int32([SEPARATOR])])
