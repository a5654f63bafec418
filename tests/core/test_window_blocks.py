"""The scheduler over KV groups (models/kv_groups.py, window_blocks.py), without a model: a full group
and sliding ones of a 16-token window over blocks of 4. A sliding group holds its window and a block
at decode, gives back the rest, forks and swaps in all groups, never leaks a block, and a reused
prefix only takes blocks the prefix cache still holds: never one that went back to the pool."""

import collections

import numpy as np

from models import ModelConfig
from models.config import FULL, SLIDING
from models.kv_groups import KVGroups, kv_groups
from paged_jax.core.block_manager import BlockManager
from paged_jax.core.block_pool import NULL_BLOCK
from paged_jax.core.config import EngineConfig
from paged_jax.core.scheduler import Scheduler
from paged_jax.core.sequence import Status
from paged_jax.core.window_blocks import group_name, max_tokens
from test_scheduler import BS, FakeSwapper, Harness

WINDOW = 16
GROUPS = KVGroups(((1,), (0,), (2,)), (None, WINDOW, WINDOW))  # a full layer between two sliding ones


class GroupedHarness(Harness):
    outside: tuple[int, ...] = ()  # blocks held by no sequence the scheduler knows

    def step(self):
        """One engine step, as Harness's, then the check of every group's blocks."""
        out = self.scheduler.schedule()
        samples = [s.samples for s in out.scheduled]
        for s in out.scheduled:
            s.seq.num_computed_tokens += s.num_new_tokens
        check_groups(self.scheduler, out, self.outside)
        for s, sampled in zip(out.scheduled, samples):
            if sampled:
                s.seq.token_ids.append(1000 * s.seq.seq_id + s.seq.num_tokens)
                if s.seq.num_output_tokens >= self.max_tokens:
                    self.scheduler.finish(s.seq)
                    self.finished.append(s.seq)
        return out


def grouped(num_blocks: int = 96, max_tokens: int = 4, **options) -> GroupedHarness:
    config = EngineConfig(**options)
    blocks = BlockManager(num_blocks, BS, config.enable_prefix_caching, functional_pool=False)
    return GroupedHarness(Scheduler(config, blocks, swapper=FakeSwapper(), kv_groups=GROUPS), max_tokens)


def check_groups(scheduler: Scheduler, out, outside=()) -> None:
    """Every block's references are those of the running sequences, in every group, and the prefix
    cache's; a sliding group holds, of a sequence this step ran, what its window still reads and the
    blocks its new tokens land in, NULL_BLOCK below: at decode at most its window and a block."""
    held = collections.Counter(b for s in scheduler.running for ids in [s.block_ids, *s.group_block_ids]
                               for b in ids if b != NULL_BLOCK)
    if scheduler.blocks.cache is not None:
        held.update(scheduler.blocks.cache.cached_ids())
    held.update(outside)
    refcounts = scheduler.blocks.refcounts
    assert {int(b): int(refcounts[b]) for b in np.flatnonzero(refcounts)} == dict(held)
    for s in out.scheduled:
        computed_before = s.seq.num_computed_tokens - s.num_new_tokens
        assert len(s.seq.group_block_ids) == 2
        for ids in s.seq.group_block_ids:
            assert len(ids) == len(s.seq.block_ids) >= -(-s.seq.num_computed_tokens // BS)
            first = max(0, computed_before - WINDOW + 1) // BS
            assert ids[:first] == [NULL_BLOCK] * first and NULL_BLOCK not in ids[first:]
            if s.num_new_tokens == 1:
                assert len(ids) - first <= WINDOW // BS + 1
    for s in scheduler.waiting:
        assert s.status is Status.WAITING and s.block_ids == [] and not any(s.group_block_ids)


def assert_all_free(h: Harness) -> None:
    assert not h.scheduler.has_unfinished()
    h.scheduler.blocks.reset_prefix_cache()
    assert h.scheduler.blocks.num_free == h.scheduler.blocks.num_blocks - 1


def test_gemma3_groups_and_what_a_long_sequence_holds():
    config = ModelConfig(architecture="gemma3_text", vocab_size=8, hidden_size=8, intermediate_size=8,
                         num_layers=18, num_heads=1, num_kv_heads=1, head_dim=8, rms_norm_eps=1e-6, rope_theta=1e6,
                         max_position_embeddings=32768,
                         sliding_window=512, layer_types=tuple(SLIDING if (i + 1) % 6 else FULL for i in range(18)))
    groups = kv_groups(config)
    assert groups.layers[0] == (5, 11, 17) and groups.windows == (None,) + (512,) * 5 and groups.num_arrays == 3
    assert groups.layers[1:] == ((0, 1, 2), (3, 4, 6), (7, 8, 9), (10, 12, 13), (14, 15, 16))
    assert kv_groups(config, hybrid=False).num_groups == 1
    # One 8k sequence in 16-token blocks: 512 full blocks, and each sliding group 33 at decode, or its
    # window and a 1,024-token chunk in prefill (97).
    assert max_tokens(groups, 512 + 5 * 97, 16, 1024) == 8192
    assert max_tokens(kv_groups(config, hybrid=False), 512, 16, 1024) == 8192


def test_sliding_groups_give_back_what_the_window_passed_and_nothing_leaks():
    h = grouped(max_num_batched_tokens=12, max_tokens=40)
    seqs = [h.add(50, first=100 * i) for i in range(3)]
    h.run()
    assert h.finished == seqs
    assert_all_free(h)


def test_forks_and_swaps_cover_every_group():
    h = grouped(num_blocks=40, max_tokens=30, max_num_batched_tokens=16, preemption_mode="swap",
                enable_prefix_caching=False)
    h.add(30, n=2)
    h.add(30, first=500)
    h.run()
    swapper = h.scheduler.swapper
    assert h.scheduler.num_preemptions > 0 and swapper.swapped_in
    assert_all_free(h)


def test_a_reused_prefix_never_reaches_a_block_given_back():
    """A prefix of 14 blocks whose sliding group 1 lost block 11 to the pool (evicted, then taken by
    another sequence): a query at block n reads blocks n - 4 .. n - 1 through the window, so the longest
    prefix every group still holds is 11 blocks. Without the rule, the 14 blocks would reuse block 11's
    id, now another sequence's."""
    h = grouped(max_num_batched_tokens=64, max_tokens=2)
    prompt = list(range(1000, 1060))
    first = h.add(60, tokens=prompt)
    h.run()
    blocks, cache = h.scheduler.blocks, h.scheduler.blocks.cache
    name = group_name(first.block_hashes[11], 1)
    lost = cache.get(name)
    assert lost is not None and blocks.refcounts[lost] == 1  # only the cache holds it
    del cache._blocks[name]  # evicted, as the least recently used would be
    cache._named[lost] = False
    blocks.free([lost])
    taken = blocks.allocate(blocks.num_free)  # by another sequence
    assert lost in taken
    h.outside = taken
    again = h.add(60, tokens=prompt)
    h.step()
    assert again.num_prefix_hit_tokens == 11 * BS
    for g, ids in enumerate([again.block_ids, *again.group_block_ids]):
        for j, b in enumerate(ids[:11]):
            if b != NULL_BLOCK:
                assert b != lost and cache.get(first.block_hashes[j] if g == 0 else group_name(first.block_hashes[j], g)) == b
    assert again.group_block_ids[0][:7] == [NULL_BLOCK] * 7  # below the window at block 11
    h.run()
    blocks.free(taken)
    assert_all_free(h)
