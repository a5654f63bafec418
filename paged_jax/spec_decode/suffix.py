"""Suffix decoding (Oliaro et al., 2024; arctic-inference's "suffix" method), on a depth-bounded trie.

Every substring of at most `depth` tokens is a path from the root, each node counting the substring's
occurrences. A draft starts at the node of the context's longest suffix found in the trie and follows
the most frequent child while the product of the children's shares (the estimate of each draft
token's chance) stays at least `min_token_prob`; its length is also capped at `max_spec_factor` times
the match's length, so a long, frequent match drafts far and a short or rare one little or nothing.
A child's share is its count over its siblings' together, not over its parent's: the parent also
counts the occurrences that end a text, the context's own among them, and those say nothing of what
follows (over the parent's count, a suffix seen once before drafts at one chance in two).

Two tries are searched, the better draft (by its expected accepted tokens) kept: one per sequence
over its prompt and output, extended as tokens come, and one shared over the outputs of the last
`max_cached_requests` finished sequences, each removed again (its counts taken back, empty nodes
pruned) once it is older, so the shared trie's size is bounded. Inserting a token touches one node per
depth (the suffixes ending at it), so a trie costs O(depth) a token.
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

    def draft(self, context: list[int], k: int, min_token_prob: float, max_spec_factor: float,
              start: tuple[_Node | None, int] | None = None) -> tuple[list[int], float]:
        """Up to k drafts continuing context, and their score (the sum of their estimated chances);
        start: match(context, depth - 1) where the caller knows it."""
        node, m = start or self.match(context, self.depth - 1)
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

    def longest_open(self, open_paths: list[tuple[_Node, int]]) -> tuple[_Node | None, int]:
        """match() of a text added to this trie, from its open paths (which hold the nodes of its
        suffixes, shortest first): the longest under depth with a continuation; no walk from the root."""
        for node, length in reversed(open_paths):
            if 0 < length < self.depth and node.children:
                return node, length
        return None, 0


def _size(node: _Node) -> int:
    return 1 + sum(_size(c) for c in node.children.values())


@dataclasses.dataclass(frozen=True)
class SuffixOptions:
    depth: int = 24  # arctic-inference's max_tree_depth
    max_cached_requests: int = 1000
    min_token_prob: float = 0.1
    max_spec_factor: float = 1.0


class SuffixProposer:
    """Drafts for running sequences from their own trie and the shared one of finished outputs.

    Keyed by a sequence's id: `propose` catches its trie up with the tokens it has not seen,
    `finish` moves the sequence's output into the shared trie (and forgets its own)."""

    def __init__(self, options: SuffixOptions = SuffixOptions()):
        self.options = options
        self.shared = SuffixTrie(options.depth)
        self._cached: collections.deque[np.ndarray] = collections.deque()
        self._own: dict[int, tuple[SuffixTrie, list, int]] = {}  # seq id -> trie, open paths, tokens seen

    def propose(self, seq_id: int, tokens: list[int], k: int) -> list[int]:
        """tokens: the sequence's prompt then output -> up to k drafts."""
        if seq_id not in self._own:
            trie = SuffixTrie(self.options.depth)
            self._own[seq_id] = (trie, [(trie.root, 0)], 0)
        trie, paths, seen = self._own[seq_id]
        paths = trie.extend(paths, tokens[seen:])
        self._own[seq_id] = (trie, paths, len(tokens))
        o = self.options
        context = tokens[-(o.depth - 1):]
        own = trie.draft(context, k, o.min_token_prob, o.max_spec_factor, trie.longest_open(paths))
        shared = self.shared.draft(context, k, o.min_token_prob, o.max_spec_factor)
        return max(own, shared, key=lambda d: d[1])[0]

    def finish(self, seq_id: int, output: list[int]) -> None:
        """A sequence ended: its output joins the shared trie, the oldest cached one leaving if full."""
        self._own.pop(seq_id, None)
        if not output or self.options.max_cached_requests <= 0:
            return
        self.shared.extend([(self.shared.root, 0)], output)
        self._cached.append(np.asarray(output))
        if len(self._cached) > self.options.max_cached_requests:
            self.shared.extend([(self.shared.root, 0)], self._cached.popleft(), weight=-1)
