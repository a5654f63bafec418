"""Beam search over forked sequences.

Each step every live beam proposes its 2 * width most likely next tokens (from the sampler's top
logprobs). Of all proposals, ranked by cumulative logprob, the best `width` that do not end the
sequence survive; proposals that end it (EOS or a stop token) become finished hypotheses. A parent
whose proposal survives once continues in place; each further survivor of the same parent forks it,
sharing its KV blocks until its first write (copy-on-write). Parents with no survivor are freed.

The search stops when `width` hypotheses have finished (HF's early_stopping=True) or the live beams
reach max_tokens; the answer is the best `width` hypotheses by cumulative logprob / length**length_penalty.
"""

import dataclasses

from paged_jax.core.sequence import Sequence


@dataclasses.dataclass(frozen=True)
class Hypothesis:
    token_ids: tuple[int, ...]
    cumulative_logprob: float
    finish_reason: str
    stop_reason: int | None = None

    def score(self, length_penalty: float) -> float:
        return self.cumulative_logprob / max(len(self.token_ids), 1) ** length_penalty


@dataclasses.dataclass(frozen=True)
class Selection:
    """One step's outcome: (parent, token, new cumulative logprob) per surviving beam, best first, and
    the hypotheses that finished."""

    survivors: list[tuple[Sequence, int, float]]
    finished: list[Hypothesis]


def select(beams: list[Sequence], width: int, ending: frozenset[int], banned: frozenset[int]) -> Selection:
    """Rank every beam's proposals. ending: ids that finish a hypothesis (EOS, stop tokens);
    banned: ids no beam may take yet (min_tokens not reached)."""
    proposals = sorted(
        ((beam.cumulative_logprob + logprob, i, token) for i, beam in enumerate(beams)
         for token, logprob in beam.beam_candidates if token not in banned),
        key=lambda p: (-p[0], p[1]))
    survivors, finished = [], []
    for total, i, token in proposals:
        if len(survivors) == width:
            break
        beam = beams[i]
        if token in ending:
            finished.append(Hypothesis((*beam.output_token_ids, token), total, "stop", token))
        else:
            survivors.append((beam, token, total))
    return Selection(survivors, finished)


def best(hypotheses: list[Hypothesis], width: int, length_penalty: float) -> list[Hypothesis]:
    return sorted(hypotheses, key=lambda h: -h.score(length_penalty))[:width]
