"""A step's draft budget shared by the chance of each draft token being accepted, and that chance
estimated per sequence from its last verify steps.

A step verifies at most `budget` draft tokens (SpeculativeConfig.max_draft_tokens_per_step): past it a
CPU's step costs more per row than the accepted drafts save. Shared evenly, a sequence whose proposer
found no match leaves its share unused while another's long, sure match is cut; shared by chance, the
budget goes to the draft positions likeliest to be accepted, wherever they are. Draft j (from 0) of a
sequence is accepted only if all before it are, so with a per-token chance p its chance is p ** (j + 1):
the positions kept are the `budget` of highest chance, each sequence's a prefix of its drafts.

A sequence's chance p is the share of its drafts' tokens accepted where each verify step is a run of
Bernoulli trials that ends at the first rejection (a step that accepts all its drafts ends none):
accepted / (accepted + rejections), over counts that decay by DECAY a verify step, so a sequence that
moves from copying to writing its own text loses its priority within a few steps.
"""

import dataclasses

DECAY = 0.7  # a verify step's weight against the one after it: about the last three steps count
PRIOR = (3.0, 1.0)  # (accepted, rejections) a sequence starts with: a chance of 0.75, forgotten as above


@dataclasses.dataclass
class Chance:
    """A sequence's decayed counts of accepted draft tokens and of rejections."""

    accepted: float = PRIOR[0]
    rejected: float = PRIOR[1]

    @property
    def rate(self) -> float:
        return self.accepted / (self.accepted + self.rejected)

    def update(self, num_drafts: int, num_accepted: int) -> None:
        self.accepted = DECAY * self.accepted + num_accepted
        self.rejected = DECAY * self.rejected + (num_accepted < num_drafts)


def share(lengths: list[int], rates: list[float], budget: int) -> list[int]:
    """lengths[s]: the drafts sequence s has; rates[s]: its per-token chance -> how many of them it keeps,
    at most `budget` in all: the positions of highest chance rates[s] ** (j + 1), ties to the earlier
    position, then to the earlier sequence (equal sequences take turns)."""
    if sum(lengths) <= budget:
        return list(lengths)
    positions = sorted(((-rates[s] ** (j + 1), j, s) for s, n in enumerate(lengths) for j in range(n)))
    kept = [0] * len(lengths)
    for _, _, s in positions[:budget]:
        kept[s] += 1
    return kept
