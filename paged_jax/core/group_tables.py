"""A step's page tables and slot mappings for each KV group (models/kv_groups.py), where the model's
layers form several: the first group's are those batch.py builds from seq.block_ids, the others' are
the same made from each sequence's seq.group_block_ids (window_blocks.py). A sliding group's entries
behind its window are NULL_BLOCK, which its layers' kernels never read."""

import dataclasses
import itertools

import numpy as np

from paged_jax.core.batch import StepInput
from paged_jax.core.scheduler_output import ScheduledSeq


def with_group_tables(step: StepInput, scheduled: list[ScheduledSeq], block_size: int, num_groups: int) -> StepInput:
    """step (built by batch.py, numpy arrays) with its metadata a tuple of num_groups AttentionMetadata:
    its own, then one per further group, which differ in block_tables (int32 [rows, width]) and
    slot_mapping (int32 [tokens], -1 for padding) alone. scheduled: the step's sequences, in its order."""
    metadata = step.metadata
    rows = len(scheduled)
    counts = np.fromiter((s.num_new_tokens for s in scheduled), np.int32, rows)
    num_tokens = int(counts.sum())
    # Each real token's row and logical block: a few numpy calls per group, whatever the batch.
    token_rows = np.repeat(np.arange(rows), counts)
    positions = step.positions[:num_tokens]
    lengths = np.fromiter((len(s.seq.block_ids) for s in scheduled), np.int32, rows)
    filled = np.arange(metadata.block_tables.shape[1]) < lengths[:, None]
    tables = [metadata]
    for g in range(num_groups - 1):
        block_tables = np.zeros_like(metadata.block_tables)
        block_tables[:rows][filled] = np.fromiter(
            itertools.chain.from_iterable(s.seq.group_block_ids[g] for s in scheduled), np.int32, lengths.sum())
        slots = np.full_like(metadata.slot_mapping, -1)
        slots[:num_tokens] = block_tables[token_rows, positions // block_size] * block_size + positions % block_size
        tables.append(dataclasses.replace(metadata, block_tables=block_tables, slot_mapping=slots))
    return dataclasses.replace(step, metadata=tuple(tables))
