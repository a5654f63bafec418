"""Speculative decoding in the engine's step: drafts proposed before scheduling, verified in the step
that computes them, the rejected ones' KV given back after.

A decoding sequence's last token and its k drafts are k + 1 new tokens of one flat ragged step, laid
out like a prompt chunk (batch.py); the step takes the target's logits at each of them (k + 1 head
rows, `verify_inputs`) and the rejection sampler (rejection.py) answers per row whether to go on and
what to emit. Drafts live in Sequence.draft_ids, counted in its tokens (the scheduler's budget and
block reservation count them) and never in token_ids (the prefix cache names blocks of token_ids
only, so a block holding a draft is never registered). After the step (`settle`) the sequence's
computed length goes back to its accepted tokens and the blocks past its next token are freed.

Steps with drafts run synchronously: the proposer needs every sequence's tokens read.
"""

import dataclasses

import jax
import numpy as np

from paged_jax.core import output_processor
from paged_jax.core.scheduler_output import ScheduledSeq
from paged_jax.core.sequence import Sequence, Status
from paged_jax.spec_decode.config import SpeculativeConfig
from paged_jax.spec_decode.draft_budget import Chance, share
from paged_jax.spec_decode.ngram import propose_ngram
from paged_jax.spec_decode.rejection import num_accepted
from paged_jax.spec_decode.suffix import SuffixOptions, SuffixProposer


@dataclasses.dataclass
class SpecStats:
    """Counters since the engine started, under vLLM's metric names (less their prefix)."""

    num_drafts: int = 0  # sequences' drafts verified (one per sequence and step)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = dataclasses.field(default_factory=list)  # [k]


@dataclasses.dataclass
class _Acceptance:
    drafted: int = 0
    accepted: int = 0
    resume_at: int = 0  # output tokens after which a sequence paused for low acceptance drafts again
    chance: Chance = dataclasses.field(default_factory=Chance)  # its share of the step's draft budget


class Speculator:
    def __init__(self, config: SpeculativeConfig, max_model_len: int, num_head_rows: int, block_size: int,
                 draft_budget: int | None = None):
        """draft_budget: the most draft tokens a step verifies (config.max_draft_tokens_per_step, or the
        engine's choice for its device where that is None; None: no budget beyond k a sequence)."""
        self.config = config
        self.draft_budget = draft_budget
        self.max_model_len = max_model_len
        self.num_head_rows = num_head_rows
        self.block_size = block_size
        self.stats = SpecStats(accepted_per_position=[0] * config.num_speculative_tokens)
        self.suffix = SuffixProposer(SuffixOptions(
            config.suffix_decoding_max_tree_depth, config.suffix_decoding_max_cached_requests,
            config.suffix_decoding_min_token_prob, config.suffix_decoding_max_spec_factor,
        )) if config.method == "suffix" else None
        self._seen: dict[int, tuple[Sequence, _Acceptance]] = {}
        self.drafting = False  # whether the last propose gave drafts (fit has none to cut otherwise)

    def forget_outputs(self) -> None:
        """Empty suffix decoding's cache of finished outputs (a benchmark's runs then start alike)."""
        self._forget_finished()  # else the sequences finished in the last step join the new cache
        if self.suffix is not None:
            self.suffix = SuffixProposer(self.suffix.options)

    def active(self, running: list[Sequence]) -> bool:
        """Whether this step drafts: below disable_by_batch_size."""
        limit = self.config.disable_by_batch_size
        return bool(running) and (limit is None or len(running) < limit)

    def propose(self, running: list[Sequence]) -> None:
        """Give each decoding sequence its drafts for the next step (none where speculation cannot
        help: a constrained or beam row, a parent of n samples, a token pending, the end in sight), cut
        to the step's draft budget by their chances of acceptance."""
        self._forget_finished()
        if not self.active(running):  # off by batch size: no work per sequence and step
            if self.drafting:
                for seq in running:
                    seq.draft_ids = []
                self.drafting = False
            return
        drafts = [self._drafts(seq, self.config.num_speculative_tokens) for seq in running]
        if self.draft_budget is not None:
            rates = [self._seen[seq.seq_id][1].chance.rate if seq.seq_id in self._seen else 0.0 for seq in running]
            kept = share([len(d) for d in drafts], rates, self.draft_budget)
            drafts = [d[:n] for d, n in zip(drafts, kept)]
        for seq, d in zip(running, drafts):
            seq.draft_ids = d
        self.drafting = True

    def _drafts(self, seq: Sequence, k: int) -> list[int]:
        if (seq.num_pending or seq.forks > 1 or seq.guide is not None or seq.params.use_beam_search
                or seq.num_computable_tokens - seq.num_computed_tokens != 1):
            return []
        k = min(k, seq.params.max_tokens - seq.num_output_tokens - 1, self.max_model_len - len(seq.token_ids))
        _, acceptance = self._seen.setdefault(seq.seq_id, (seq, _Acceptance()))
        if k <= 0 or seq.num_output_tokens < acceptance.resume_at:
            return []
        if self.suffix is not None:
            return self.suffix.propose(seq.token_ids, k)
        c = self.config
        return propose_ngram(np.asarray(seq.token_ids), k, c.prompt_lookup_min, c.prompt_lookup_max).tolist()

    def _forget_finished(self) -> None:
        for seq_id, (seq, _) in list(self._seen.items()):
            if seq.status is not Status.RUNNING:
                del self._seen[seq_id]
                if self.suffix is not None:
                    self.suffix.finish(seq.output_token_ids if seq.status is Status.FINISHED else [])
                seq.draft_ids = []

    def fit(self, scheduled: list[ScheduledSeq], others: list[Sequence]) -> tuple[list[ScheduledSeq], bool]:
        """The scheduled step with each sequence's drafts cut to what it was given room for (the
        budget may have cut it short) and to the head's rows (a row per sequence and one per draft,
        at most num_head_rows), and whether any draft is left. The others (running or preempted, and
        not scheduled) drop theirs."""
        if not self.drafting:
            return scheduled, False
        rows = len(scheduled)
        out = []
        for s in scheduled:
            seq = s.seq
            if not seq.draft_ids:
                out.append(s)
                continue
            keep = min(len(seq.draft_ids), s.num_new_tokens - 1, self.num_head_rows - rows)
            seq.draft_ids = seq.draft_ids[: max(keep, 0)]
            rows += len(seq.draft_ids)
            out.append(ScheduledSeq(seq, 1 + len(seq.draft_ids)))
        scheduled_ids = {id(s.seq) for s in out}
        for seq in others:
            if id(seq) not in scheduled_ids:
                seq.draft_ids = []
        return out, any(s.seq.draft_ids for s in out)

    def verify_inputs(self, runner, scheduled: list[ScheduledSeq]):
        """The step's host arrays with a head row per draft: (StepInput, SamplingTensors, int32 [S]
        drafts, -1 where a row has none) for ModelRunner.dispatch. A row after j drafts counts them as
        output (its step, its bans until min_tokens, its penalties' history)."""
        step_input = runner.inputs.batch(scheduled)  # each token row on its sequence's LoRA slot, drafts too
        starts = step_input.metadata.query_start_loc
        indices, params, seeds, prompt_ids, output_ids, guides, drafts = [], [], [], [], [], [], []
        penalties = any(s.seq.params.uses_penalties for s in scheduled)
        for i, s in enumerate(scheduled):
            seq, d = s.seq, len(s.seq.draft_ids)
            end = int(starts[i]) + s.num_new_tokens
            indices.extend(range(end - 1 - d, end))
            drafts.extend(seq.draft_ids + [-1])
            prompt = seq.token_ids[: seq.num_prompt_tokens] if penalties else ()
            for j in range(d + 1):
                params.append(seq.params)
                seeds.append((seq.seed * 31 + seq.index) % (2**31 - 1))
                prompt_ids.append(prompt)
                output_ids.append(seq.output_token_ids + seq.draft_ids[:j] if penalties
                                  else range(seq.num_output_tokens + j))
                guides.append(seq.guide if s.samples else None)
        step_input.logits_indices[:] = 0
        step_input.logits_indices[: len(indices)] = indices
        tensors = runner.inputs.sampling(params, seeds, prompt_ids, output_ids, guides)
        rows = tensors.temperature.shape[0]
        return step_input, tensors, np.pad(np.asarray(drafts, np.int32), (0, rows - len(drafts)), constant_values=-1)

    @staticmethod
    def read(request, seq: Sequence, sampled, accepted, row: int, num_drafts: int, now: float, stops):
        """Append seq's tokens from a step with drafts (rows row .. row + num_drafts of sampled, a
        SamplerOutput on the host; accepted as rejection.py gives it): its accepted drafts' rows and the
        row after (the target's own token, or the bonus), up to a stop. (accepted drafts, finish reason
        or None), as output_processor.append_tokens gives it."""
        n = num_accepted(accepted, row, num_drafts)
        # Its rows as consecutive steps of one row, as a multi-step dispatch's samples are laid out.
        rows = jax.tree.map(lambda x: x[row : row + n + 1, None], sampled)
        return n, output_processor.append_tokens(request, seq, rows, 0, n + 1, now, stops)

    def settle(self, seq: Sequence, num_drafts: int, num_accepted: int, blocks) -> None:
        """After seq's verified tokens are appended: count them, take its computed length back to
        its accepted tokens, and free the blocks past the one its next token goes in."""
        st = self.stats
        if num_drafts:
            st.num_drafts += 1
            st.num_draft_tokens += num_drafts
            st.num_accepted_tokens += num_accepted
            for j in range(num_accepted):
                st.accepted_per_position[j] += 1
            self._track(seq, num_drafts, num_accepted)
        seq.draft_ids = []
        if seq.is_finished:
            return
        seq.num_computed_tokens = min(seq.num_computed_tokens, len(seq.token_ids) - 1)
        keep = -(-len(seq.token_ids) // self.block_size)
        if len(seq.block_ids) > keep:
            blocks.free(seq.block_ids[keep:])
            del seq.block_ids[keep:]

    def _track(self, seq: Sequence, num_drafts: int, num_accepted: int) -> None:
        """Update seq's chance of acceptance; pause it, for as many output tokens as the window, if
        its drafts keep failing."""
        c = self.config
        entry = self._seen.get(seq.seq_id)
        if entry is None:
            return
        a = entry[1]
        a.chance.update(num_drafts, num_accepted)
        if c.min_acceptance_rate <= 0:
            return
        a.drafted += num_drafts
        a.accepted += num_accepted
        if a.drafted >= c.acceptance_window:
            if a.accepted < c.min_acceptance_rate * a.drafted:
                a.resume_at = seq.num_output_tokens + c.acceptance_window
            a.drafted = a.accepted = 0

