"""A sequence's hold on the block pool outside the ordinary step: given up (preemption, finish), got back
(swap-in), shared with a fork. The scheduler decides when; these say how, for one sequence."""

import dataclasses
from typing import Protocol

from paged_jax.core.block_manager import BlockManager
from paged_jax.core.sequence import Sequence
from paged_jax.core.window_blocks import WindowBlocks


class KVSwapper(Protocol):
    def swap_out(self, block_ids: list[int]) -> object: ...

    def swap_in(self, saved: object, block_ids: list[int]) -> None: ...


def shared_tail(seq: Sequence, blocks: BlockManager) -> int | None:
    """Index in seq.block_ids of the partly filled block its next token lands in, if a fork shares it."""
    if seq.num_computed_tokens % blocks.block_size == 0:
        return None  # the next token opens a fresh block
    index = seq.num_computed_tokens // blocks.block_size
    return index if blocks.is_shared(seq.block_ids[index]) else None


def release(seq: Sequence, blocks: BlockManager, windows: WindowBlocks | None,
            swapper: KVSwapper | None = None) -> None:
    """Free seq's blocks, its KV groups' too (prefix-cached ones stay cached). With a swapper, the KV of
    its computed tokens goes to host memory first (seq.swapped_kv), to come back by `swap_in`."""
    if swapper is not None and seq.num_computed_tokens > 0:
        num_blocks = -(-seq.num_computed_tokens // blocks.block_size)
        ids = seq.block_ids[:num_blocks]
        if windows is not None:
            windows.remove_skipped(seq)
            ids += windows.swap_ids(seq, num_blocks)
        seq.swapped_kv = swapper.swap_out(ids)
    blocks.free(seq.block_ids)
    if windows is not None:
        windows.free(seq)
    seq.block_ids = []
    seq.num_cached_blocks = 0


def swap_in(seq: Sequence, blocks: BlockManager, windows: WindowBlocks | None, swapper: KVSwapper,
            need: int) -> None:
    """Give a swapped-out seq `need` fresh blocks (and its groups theirs) and bring its KV back into them;
    the caller has checked they can be allocated."""
    num_blocks = -(-seq.num_computed_tokens // blocks.block_size)
    seq.block_ids = blocks.allocate(need)
    restored = [] if windows is None else windows.restore(seq, need, num_blocks)
    swapper.swap_in(seq.swapped_kv, seq.block_ids[:num_blocks] + restored)
    seq.swapped_kv = None


def fork(parent: Sequence, blocks: BlockManager, windows: WindowBlocks | None, *, seq_id: int,
         index: int) -> Sequence:
    """A copy of parent that shares its KV blocks (copy-on-write), with a copy of its constraint's matcher."""
    child = dataclasses.replace(parent, seq_id=seq_id, index=index, forks=1, token_ids=list(parent.token_ids),
                                block_ids=list(parent.block_ids), block_hashes=list(parent.block_hashes),
                                group_block_ids=[list(ids) for ids in parent.group_block_ids],
                                logprobs=[], beam_candidates=None,
                                guide=parent.guide and parent.guide.fork())
    blocks.share(parent.block_ids)
    if windows is not None:
        windows.share(parent)
    return child
