"""A still picture of the block pool and the scheduler's queues, for the live view (the server's
/dashboard) and the offline one (scripts/visualize.py).

    snap = pool_snapshot(engine)           # on the thread that owns the engine, between two steps
    state, refs, owner = block_states(snap)  # anywhere, later

This is the one door into the pool and the queues for code outside core: a viewer reads these copies
and never the scheduler or the block manager, which move on with the next step. Taking one copies the
pool's reference counts (a NumPy array), the prefix cache's block ids and each live sequence's page
table: tens of microseconds for a few hundred sequences, so a viewer may take one every half second.
"""

import time

import numpy as np

from paged_jax.core.block_pool import NULL_BLOCK
from paged_jax.core.sequence import Status

# A physical block's state, as block_states gives it.
FREE, HELD, SHARED, CACHED, RESERVED = 0, 1, 2, 3, 4
STATE_NAMES = ("free", "held", "shared", "cached", "reserved")
_NONE = np.zeros(0, np.int32)  # the group blocks of a snapshot taken before there were KV groups


def pool_snapshot(engine) -> dict:
    """The engine's pool and queues now (see scheduler_snapshot); call it where the engine's steps run."""
    return scheduler_snapshot(engine.scheduler, engine.blocks)


def scheduler_snapshot(scheduler, blocks) -> dict:
    """The pool and queues of a Scheduler over a BlockManager (an engine's, or a replay's).

    returns a dict:
      time: float, time.monotonic() when taken
      block_size: int
      refcounts: int32 [num_blocks]; references to each physical block, the prefix cache's included
        (block 0 is reserved and never handed out)
      cached: bool [num_blocks]; named in the prefix cache, which holds one reference of its own
      num_preemptions: int, so far
      seqs: list of dicts, running ones first (in the scheduler's order), then waiting ones (queue order):
        seq_id, request_id, status ("running", "waiting", or "swapped": waiting, its KV on the host),
        priority, lora_name (its LoRA adapter's, or None), arrival_time (time.monotonic()), num_prompt_tokens, num_output_tokens,
        num_computed_tokens (tokens whose KV the blocks hold), num_preemptions,
        block_ids int32 [blocks]: the page table, logical block i -> physical block block_ids[i]
        (the last one partly filled), num_swapped_blocks: blocks of KV kept on the host,
        group_blocks int32 [k]: the blocks it holds in the KV groups past the first (window_blocks.py;
        none for a model of one group)
    """
    cached = np.zeros(blocks.num_blocks, bool)
    if blocks.cache is not None:
        cached[np.fromiter(blocks.cache.cached_ids(), np.int64, count=len(blocks.cache))] = True
    seqs = [_sequence(seq, blocks.block_size) for seq in (*scheduler.running, *scheduler.waiting)]
    return dict(time=time.monotonic(), block_size=blocks.block_size, refcounts=np.array(blocks.refcounts, np.int32),
                cached=cached, num_preemptions=scheduler.num_preemptions, seqs=seqs)


def _sequence(seq, block_size: int) -> dict:
    swapped = seq.swapped_kv is not None
    status = "running" if seq.status is Status.RUNNING else "swapped" if swapped else "waiting"
    return dict(seq_id=seq.seq_id, request_id=seq.request_id, status=status, priority=seq.priority,
                lora_name=None if seq.lora is None else seq.lora.lora_name,
                arrival_time=seq.arrival_time, num_prompt_tokens=seq.num_prompt_tokens,
                num_output_tokens=seq.num_output_tokens, num_computed_tokens=seq.num_computed_tokens,
                num_preemptions=seq.num_preemptions, block_ids=np.array(seq.block_ids, np.int32),
                group_blocks=np.array([b for ids in seq.group_block_ids for b in ids if b != NULL_BLOCK], np.int32),
                num_swapped_blocks=-(-seq.num_computed_tokens // block_size) if swapped else 0)


def block_states(snap: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each physical block's state, from a snapshot.

    returns (state int8 [num_blocks]: FREE, HELD (one sequence's), SHARED (several sequences'), CACHED
    (the prefix cache's alone: reusable, evicted when the pool runs short) or RESERVED (block 0);
    refs int32 [num_blocks]: how many sequences hold it; owner int64 [num_blocks]: seq_id of the first
    sequence in the snapshot's order that holds it, -1 if none).
    A block both cached and held by sequences is HELD or SHARED: evicting it would lose their KV.
    """
    refcounts, cached = snap["refcounts"], snap["cached"]
    num_blocks = refcounts.shape[0]
    held = [np.concatenate([s["block_ids"], s.get("group_blocks", _NONE)]) for s in snap["seqs"]]
    ids = np.concatenate(held) if held else np.zeros(0, np.int32)
    refs = np.bincount(ids, minlength=num_blocks).astype(np.int32)
    owner = np.full(num_blocks, -1, np.int64)
    # Written last to first, so the first holder's id is the one that stays.
    for s, ids in zip(reversed(snap["seqs"]), reversed(held)):
        owner[ids] = s["seq_id"]
    state = np.full(num_blocks, FREE, np.int8)
    state[(refcounts > 0) & cached] = CACHED
    state[refs == 1] = HELD
    state[refs > 1] = SHARED
    state[NULL_BLOCK] = RESERVED
    return state, refs, owner


def num_used_blocks(state: np.ndarray) -> int:
    """Blocks that sequences hold: what /metrics calls num_kv_cache_blocks{state="used"}."""
    return int(np.count_nonzero((state == HELD) | (state == SHARED)))
