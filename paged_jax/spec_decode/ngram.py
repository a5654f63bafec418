"""Prompt lookup (vLLM's "ngram" method): the tokens that followed the latest earlier occurrence of the
context's longest suffix, between prompt_lookup_min and prompt_lookup_max tokens long, are the drafts.

Host code over numpy: one vectorised comparison per suffix length over the positions where the last
token occurs, so a context of thousands of tokens costs tens of microseconds.
"""

import numpy as np


def propose_ngram(tokens: np.ndarray, k: int, min_n: int, max_n: int) -> np.ndarray:
    """tokens: int [L], the prompt then the output so far -> int32 [<= k], the drafts (empty: no match).

    Finds the longest n in [min_n, max_n] whose last-n tokens also end at an earlier position i (the
    latest such i on ties), and proposes tokens[i + 1 : i + 1 + k]. An occurrence may overlap the
    suffix itself: a repeating run proposes its own continuation."""
    tokens = np.asarray(tokens)
    L = len(tokens)
    if k <= 0 or L < min_n + 1:
        return np.zeros(0, np.int32)
    # Candidate ends i < L - 1 where the last token recurs; each extends backward while it matches.
    ends = np.flatnonzero(tokens[: L - 1] == tokens[L - 1])
    if len(ends) == 0:
        return np.zeros(0, np.int32)
    match = np.ones(len(ends), np.int64)
    alive = np.ones(len(ends), bool)
    for j in range(1, max_n):
        back = ends - j
        alive &= back >= 0
        alive[alive] &= tokens[back[alive]] == tokens[L - 1 - j]
        if not alive.any():
            break
        match += alive
    best = match.max()
    if best < min_n:
        return np.zeros(0, np.int32)
    end = ends[np.flatnonzero(match == best)[-1]]
    return tokens[end + 1 : end + 1 + k].astype(np.int32)
