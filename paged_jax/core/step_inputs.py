"""The host arrays of an engine step, built from what the scheduler gave: the flat batch and page tables
(batch.py), the sampling tensors (sampling_tensors.py), a multi-step dispatch's rows (multi_step.py),
and padding steps of every shape for the warm-up. All numpy, sized to the engine's buckets."""

import numpy as np

from models import rope
from paged_jax.core import multi_step, structured_output
from paged_jax.core.adapters import padding_forms, with_lora_rows
from paged_jax.core.batch import StepInput, build_step_input, padding_step_input
from paged_jax.core.group_tables import with_group_tables
from paged_jax.core.resolve import ResolvedConfig
from paged_jax.core.sampling_tensors import PENDING, SamplingTensors, make_sampling_tensors
from paged_jax.core.scheduler_output import ScheduledSeq


class StepInputs:
    def __init__(self, resolved: ResolvedConfig, model_config, adapters=None):
        """adapters: the engine's adapters.AdapterSlots with LoRA enabled, else None."""
        self.resolved, self.model_config, self.adapters = resolved, model_config, adapters
        self.rope_freq = rope.inv_freq(model_config)  # f32 [head_dim // 2]

    def batch(self, scheduled: list[ScheduledSeq]) -> StepInput:
        """The flat batch of these sequences' new tokens, their page tables (one per KV group), and each
        token row's LoRA slot."""
        step_input = self._group_tables(
            build_step_input(scheduled, self.resolved.block_size, self.resolved.buckets, self.rope_freq), scheduled)
        if self.adapters is not None:
            step_input = with_lora_rows(step_input, scheduled, self.adapters.max_loras)
        return step_input

    def step(self, scheduled: list[ScheduledSeq]) -> tuple[StepInput, SamplingTensors]:
        """The step's host arrays for these sequences: the flat batch and page tables, the sampling tensors."""
        seqs = [s.seq for s in scheduled]
        # A row that does not sample this step (a prompt chunk) has nothing to constrain.
        guides = [s.seq.guide if s.samples else None for s in scheduled]
        step_input = self.batch(scheduled)
        # A pending token counts as generated (the sampler's step, min_tokens) and, under penalties, is
        # read into the history on the device. Without penalties only the counts are read: ranges of
        # the right length, not copies of every sequence's tokens every step.
        params = [s.params for s in seqs]
        if any(p.uses_penalties for p in params):
            prompt_ids = [s.token_ids[: s.num_prompt_tokens] for s in seqs]
            output_ids = [s.output_token_ids + [PENDING] * s.num_pending for s in seqs]
        else:
            prompt_ids, output_ids = [()] * len(seqs), [range(s.num_output_tokens + s.num_pending) for s in seqs]
        return step_input, self.sampling(
            params, [(s.seed * 31 + s.index) % (2**31 - 1) for s in seqs], prompt_ids, output_ids, guides,
            [s.sample_row for s in seqs])

    def sampling(self, params, seeds, prompt_ids, output_ids, guides=(), pending_rows=()) -> SamplingTensors:
        """make_sampling_tensors's for these rows, padded to their bucket, with the guides' token masks."""
        rows, vocab = self.resolved.buckets.sample_rows(len(params)), self.model_config.vocab_size
        allowed = structured_output.allowed_tokens(guides, rows, vocab) if any(g is not None for g in guides) else None
        return make_sampling_tensors(
            params, seeds, prompt_ids, output_ids, self.model_config.eos_token_ids, allowed=allowed,
            pad_rows_to=rows, vocab_size=vocab, history_width=self.resolved.max_model_len, pending_rows=pending_rows)

    def decode_run(self, scheduled: list[ScheduledSeq], num_steps: list[int]) -> multi_step.DecodeRun:
        """A multi-step dispatch's host arrays: these decoding sequences, each running num_steps[i] steps."""
        step_input, tensors = self.step(scheduled)
        return self.padded_decode_run(step_input, tensors, num_steps, [not s.seq.params.ignore_eos for s in scheduled])

    def padded_decode_run(self, step_input: StepInput, tensors: SamplingTensors, num_steps: list[int],
                          stops_at_eos: list[bool]) -> multi_step.DecodeRun:
        """A DecodeRun of these arrays, each row's steps and EOS stop padded to the tensors' rows."""
        rows = tensors.temperature.shape[0]
        column = lambda values, dtype: np.pad(np.asarray(values, dtype), (0, rows - len(values)))
        return multi_step.DecodeRun(step_input, tensors, column(num_steps, np.int32), column(stops_at_eos, np.bool_))

    def padding(self, shape) -> list[StepInput]:
        """A step of padding of this shape in each form it takes (with LoRA, adapters.padding_forms)."""
        step_input = self._group_tables(padding_step_input(shape, self.resolved.buckets.num_head_rows, self.rope_freq), [])
        return [step_input] if self.adapters is None else padding_forms(step_input, self.adapters.max_loras)

    def _group_tables(self, step_input: StepInput, scheduled: list[ScheduledSeq]) -> StepInput:
        """step_input with a page table per KV group where the model's layers form several (group_tables.py)."""
        num_groups = self.resolved.kv_groups.num_groups
        if num_groups == 1:
            return step_input
        return with_group_tables(step_input, scheduled, self.resolved.block_size, num_groups)
