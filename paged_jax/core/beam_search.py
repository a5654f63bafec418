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
from collections.abc import Callable

from paged_jax.core.sampling_params import SamplingParams
from paged_jax.core.scheduler import Scheduler
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


def advance(beams: list[Sequence], params: SamplingParams, hypotheses: list[Hypothesis], scheduler: Scheduler,
            new_seq_id: Callable[[], int], eos_ids: frozenset[int], max_model_len: int, now: float) -> list[Sequence]:
    """One step of the search, once every live beam has its proposals: the survivors take their
    tokens (a parent's second survivor on is a fork of it), beams without one are freed, finished
    hypotheses join `hypotheses`. Returns the live beams, best first; once the search is over they
    are finished too, at their length's end counted as hypotheses."""
    ending = set(params.stop_token_ids) | (set() if params.ignore_eos else eos_ids)
    banned = ending if beams[0].num_output_tokens < params.min_tokens else set()
    selection = select(beams, params.n, frozenset(ending), frozenset(banned))
    hypotheses += selection.finished
    # Forks first, while every parent still holds the tokens its children continue from.
    continuing, live = set(), []
    for parent, token, total in selection.survivors:
        if parent.seq_id in continuing:
            child = scheduler.fork(parent, seq_id=new_seq_id(), index=len(live))
        else:
            continuing.add(parent.seq_id)
            child = parent
        live.append((child, token, total))
    for beam in beams:
        if beam.seq_id not in continuing:
            scheduler.finish(beam)
    for index, (beam, token, total) in enumerate(live):
        beam.token_ids.append(token)
        beam.cumulative_logprob, beam.index, beam.beam_candidates = total, index, None
    survivors = [beam for beam, _, _ in live]
    lead = survivors[0] if survivors else None
    at_length = lead is None or lead.num_output_tokens >= params.max_tokens or lead.num_tokens >= max_model_len
    if at_length or len(hypotheses) >= params.n:
        for beam in survivors:
            if at_length:
                hypotheses.append(Hypothesis(tuple(beam.output_token_ids), beam.cumulative_logprob, "length"))
            beam.finish_time = now
            scheduler.finish(beam)
    return survivors
