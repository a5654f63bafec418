"""Suffix decoding (Oliaro et al., 2024; arctic-inference's "suffix" method), on a depth-bounded trie.

Every substring of at most `depth` tokens is a path from the root, each node counting the substring's
occurrences. A draft starts at the node of the context's longest suffix found in the trie and follows
the most frequent child while the product of the children's shares (the estimate of each draft
token's chance) stays at least `min_token_prob`; its length is also capped at `max_spec_factor` times
the match's length, so a long, frequent match drafts far and a short or rare one little or nothing.
A child's share is its count over its siblings' together, not over its parent's: the parent also
counts the occurrences that end a text, the context's own among them, and those say nothing of what
follows (over the parent's count, a suffix seen once before drafts at one chance in two).

Two sources are searched, the better draft (by its expected accepted tokens) kept: the sequence's own
prompt and output, and a trie shared over the outputs of the last `max_cached_requests` finished
sequences, each removed again (its counts taken back, empty nodes pruned) once it is older, so the
shared trie's size is bounded. Inserting a token touches one node per depth (the suffixes ending at
it), so a trie costs O(depth) a token: for a sequence's own text that is tens of milliseconds of
Python per thousand prompt tokens, paid at its first draft (a step's worth on two cores), so its own
text is searched directly instead (`own_draft`, numpy over the tokens, the same counts and draft).
"""

import collections
import dataclasses

import numpy as np


class _Node:
    __slots__ = ("count", "children")

    def __init__(self):
        self.count = 0
        self.children: dict[int, _Node] = {}


class SuffixTrie:
    """Counts of every substring of at most `depth` tokens of the texts added (and not removed)."""

    def __init__(self, depth: int):
        self.depth = depth
        self.root = _Node()
        self.num_nodes = 0

    def extend(self, open_paths: list[tuple[_Node, int]], tokens, weight: int = 1) -> list[tuple[_Node, int]]:
        """Add (weight 1) or take back (weight -1) the substrings ending at each of tokens, given the
        open paths of the text before them (the nodes of its suffixes shorter than depth, with their
        lengths; [(root, 0)] for a new text). Returns the text's open paths after them."""
        for t in tokens:
            t = int(t)
            nxt = [(self.root, 0)]
            for node, length in open_paths:
                if length >= self.depth:
                    continue
                child = node.children.get(t)
                if child is None:
                    if weight < 0:
                        continue
                    child = node.children[t] = _Node()
                    self.num_nodes += 1
                child.count += weight
                if child.count <= 0:
                    self.num_nodes -= _size(child)
                    del node.children[t]
                    continue
                nxt.append((child, length + 1))
            open_paths = nxt
        return open_paths

    def match(self, context: list[int], max_len: int) -> tuple[_Node | None, int]:
        """The node of the longest suffix of context (at most max_len tokens) that has a continuation,
        and its length; (None, 0) when none has."""
        for m in range(min(max_len, len(context), self.depth - 1), 0, -1):
            node = self.root
            for t in context[len(context) - m :]:
                node = node.children.get(t)
                if node is None:
                    break
            if node is not None and node.children:
                return node, m
        return None, 0

    def draft(self, context: list[int], k: int, min_token_prob: float,
              max_spec_factor: float) -> tuple[list[int], float]:
        """Up to k drafts continuing context, and their score (the sum of their estimated chances)."""
        node, m = self.match(context, self.depth - 1)
        limit = min(k, int(np.ceil(max_spec_factor * m)))
        out, prob, score = [], 1.0, 0.0
        while node is not None and len(out) < limit:
            token, child = max(node.children.items(), key=lambda kv: kv[1].count)
            prob *= child.count / sum(c.count for c in node.children.values())
            if prob < min_token_prob:
                break
            out.append(token)
            score += prob
            # At the trie's depth the path ends: the context and drafts so far find where to go on.
            node = child if child.children else self.match(context + out, self.depth - 1)[0]
        return out, score


def _size(node: _Node) -> int:
    return 1 + sum(_size(c) for c in node.children.values())


def _longest_match(text: np.ndarray, suffix: np.ndarray, max_len: int) -> tuple[np.ndarray, int]:
    """The ends i (ascending) of the longest suffix of `suffix` (at most max_len tokens) that occurs in
    text with a token after it (i < len(text) - 1), and its length; (empty, 0) when none occurs."""
    if len(suffix) == 0:
        return np.zeros(0, np.int64), 0
    ends = np.flatnonzero(text[:-1] == suffix[-1])
    m = 1 if len(ends) else 0
    for j in range(1, min(max_len, len(suffix))):
        back = ends - j
        ok = back >= 0
        ok[ok] = text[back[ok]] == suffix[-1 - j]
        if not ok.any():
            break
        ends, m = ends[ok], m + 1
    return ends, m


def own_draft(tokens: np.ndarray, k: int, max_match: int, min_token_prob: float,
              max_spec_factor: float) -> tuple[list[int], float]:
    """SuffixTrie.draft over a text's own substrings, without building its trie: tokens: int [L], the
    text -> (up to k drafts, their score). The occurrences of the longest suffix (at most max_match
    tokens) stand for the matched node, the tokens after them for its children (their counts, ties to
    the earliest, as the trie's insertion order has it), so a proposal costs a few vectorised passes
    over the text instead of depth nodes per token of it. Unlike the trie, a path is not cut at a
    depth: it follows the occurrences as long as they last, then matches context + drafts again."""
    tokens = np.asarray(tokens)
    ends, m = _longest_match(tokens, tokens, max_match)
    limit = min(k, int(np.ceil(max_spec_factor * m)))
    out, prob, score = [], 1.0, 0.0
    while len(ends) and len(out) < limit:
        after = tokens[ends + 1]
        values, first, counts = np.unique(after, return_index=True, return_counts=True)
        best = np.flatnonzero(counts == counts.max())
        pick = best[np.argmin(first[best])]
        prob *= counts[pick] / len(after)
        if prob < min_token_prob:
            break
        out.append(int(values[pick]))
        score += prob
        ends = ends[after == values[pick]] + 1
        ends = ends[ends < len(tokens) - 1]
        if not len(ends):  # every occurrence ran into the text's end: where do the drafts so far recur?
            ends, _ = _longest_match(tokens, np.concatenate([tokens, out]), max_match)
    return out, score


@dataclasses.dataclass(frozen=True)
class SuffixOptions:
    depth: int = 24  # arctic-inference's max_tree_depth
    max_cached_requests: int = 1000
    min_token_prob: float = 0.1
    max_spec_factor: float = 1.0


class SuffixProposer:
    """Drafts for running sequences from their own tokens and the shared trie of finished outputs.

    `propose` takes a sequence's tokens as they stand (its own part needs no state: own_draft),
    `finish` moves the sequence's output into the shared trie."""

    def __init__(self, options: SuffixOptions = SuffixOptions()):
        self.options = options
        self.shared = SuffixTrie(options.depth)
        self._cached: collections.deque[np.ndarray] = collections.deque()

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """tokens: the sequence's prompt then output -> up to k drafts."""
        o = self.options
        own = own_draft(np.asarray(tokens), k, o.depth - 1, o.min_token_prob, o.max_spec_factor)
        shared = self.shared.draft(tokens[-(o.depth - 1):], k, o.min_token_prob, o.max_spec_factor)
        return max(own, shared, key=lambda d: d[1])[0]

    def finish(self, output: list[int]) -> None:
        """A sequence ended: its output joins the shared trie, the oldest cached one leaving if full."""
        if not output or self.options.max_cached_requests <= 0:
            return
        self.shared.extend([(self.shared.root, 0)], output)
        self._cached.append(np.asarray(output))
        if len(self._cached) > self.options.max_cached_requests:
            self.shared.extend([(self.shared.root, 0)], self._cached.popleft(), weight=-1)
