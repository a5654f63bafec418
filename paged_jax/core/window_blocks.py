"""The blocks of a sequence's KV groups past the first, where the model mixes full and sliding-window
attention (models/kv_groups.py): what the scheduler does to them beside what it does to the first
group's (seq.block_ids), and the sliding groups' freeing of what their window has left behind.

Every group's list (seq.group_block_ids[g - 1] for group g) is as long as the first group's: logical
block j of each holds the same tokens, for that group's layers. A sliding group's entries behind its
window are NULL_BLOCK, which the kernels never read (a query at position p reads keys above
p - window) and the block pool never hands out, so its page table keeps its shape. As vLLM's
SlidingWindowManager.remove_skipped_blocks: before a sequence computes from token c, blocks wholly
below c - window + 1 go back to the pool, so at decode a sliding group holds its window plus at most
one block.

Prefix caching names a group's block by its tokens' name and the group, so each group's blocks are
found apart. A prefix of n blocks is reused only if every group holds what a query at token n *
block_size reads: a full group all n blocks, a sliding group those its window reaches (vLLM's rule);
the longest prefix for which all do is taken, and a sliding group's entries below its window stay
NULL_BLOCK. A block is only ever reused while the cache holds a reference on it, so a reused prefix
never reaches a block that went back to the pool.
"""

from paged_jax.core.block_manager import BlockManager
from paged_jax.core.block_pool import NULL_BLOCK
from paged_jax.core.prefix_cache import ROOT_HASH, GroupName, block_hashes
from paged_jax.core.sequence import Sequence
from models.kv_groups import KVGroups


def first_needed(window: int | None, num_computed: int, block_size: int) -> int:
    """The first logical block that queries from token num_computed on read through window (None: all)."""
    return 0 if window is None else max(0, num_computed - window + 1) // block_size


def max_blocks(window: int | None, num_tokens: int, block_size: int, chunk: int) -> int:
    """Most blocks a group holds for a sequence of num_tokens tokens computed in steps of at most
    chunk tokens: a sliding group its window, the chunk, and the blocks they straddle."""
    blocks = -(-num_tokens // block_size)
    return blocks if window is None else min(blocks, -(-(window + chunk) // block_size) + 1)


def max_tokens(groups: KVGroups, num_blocks: int, block_size: int, chunk: int) -> int:
    """The longest sequence that num_blocks blocks always hold, in every group at once."""
    need = lambda n: sum(max_blocks(w, n, block_size, chunk) for w in groups.windows)
    low, high = 0, num_blocks * block_size  # need(low) <= num_blocks < need(high + 1)
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if need(mid) <= num_blocks else (low, mid - 1)
    return low


def group_name(name: int, group: int) -> GroupName:
    """A block's name in the prefix cache, for a group past the first: its tokens' name and its group."""
    return GroupName(hash((int(name), group)))


class WindowBlocks:
    """What the scheduler does to the groups past the first, through the engine's one BlockManager."""

    def __init__(self, blocks: BlockManager, groups: KVGroups):
        if groups.windows[0] is not None:
            raise ValueError("the first KV group keeps its blocks: it must not slide")
        self.blocks = blocks
        self.block_size = blocks.block_size
        self.windows = groups.windows[1:]

    def lists(self, seq: Sequence) -> list[list[int]]:
        """seq's block lists of the groups past the first, made empty if it has none yet."""
        if len(seq.group_block_ids) != len(self.windows):
            seq.group_block_ids = [[] for _ in self.windows]
        return seq.group_block_ids

    def held(self, lists: list[list[int]]) -> list[int]:
        """The blocks lists hold (NULL_BLOCK entries are none)."""
        return [b for ids in lists for b in ids if b != NULL_BLOCK]

    def remove_skipped(self, seq: Sequence) -> None:
        """Give back each sliding group's blocks that no query from seq.num_computed_tokens on reads."""
        freed = []
        for window, ids in zip(self.windows, self.lists(seq)):
            for j in range(min(first_needed(window, seq.num_computed_tokens, self.block_size), len(ids)) - 1, -1, -1):
                if ids[j] == NULL_BLOCK:
                    break  # those before were given back already
                freed.append(ids[j])
                ids[j] = NULL_BLOCK
        self.blocks.free(freed)

    def _shared_tails(self, seq: Sequence) -> list[int]:
        """Groups (indices of seq.group_block_ids) whose partly filled block the next token lands in is shared."""
        if seq.num_computed_tokens % self.block_size == 0:
            return []
        j = seq.num_computed_tokens // self.block_size
        return [g for g, ids in enumerate(self.lists(seq)) if j < len(ids) and self.blocks.is_shared(ids[j])]

    def num_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks these groups take for seq to hold num_tokens tokens: those they lack, and private
        copies of shared tail blocks."""
        blocks = -(-num_tokens // self.block_size)
        return sum(max(0, blocks - len(ids)) for ids in self.lists(seq)) + len(self._shared_tails(seq))

    def reserve(self, seq: Sequence, num_tokens: int, copies: list[tuple[int, int]]) -> None:
        """Take num_needed(seq, num_tokens) blocks (the caller checked they can be had); the copies to
        make go on copies, as (src, dst)."""
        lists = self.lists(seq)
        for g in self._shared_tails(seq):
            j = seq.num_computed_tokens // self.block_size
            src, lists[g][j] = self.blocks.copy_on_write(lists[g][j])
            copies.append((src, lists[g][j]))
        blocks = -(-num_tokens // self.block_size)
        for ids in lists:
            ids.extend(self.blocks.allocate(max(0, blocks - len(ids))))

    def free(self, seq: Sequence) -> None:
        self.blocks.free(self.held(self.lists(seq)))
        seq.group_block_ids = [[] for _ in self.windows]

    def share(self, seq: Sequence) -> None:
        """A reference on each block seq holds in these groups (a fork)."""
        self.blocks.share(self.held(self.lists(seq)))

    # Prefix caching.

    def match_prefix(self, token_ids: list[int], root: int = ROOT_HASH) -> tuple[list[int], list[list[int]]]:
        """The longest cached prefix every group can reuse, leaving a token to compute: the first
        group's blocks, and each other group's list (NULL_BLOCK below its window). The caller shares
        them (admit) once admission is certain. root: as BlockManager.match_prefix takes it."""
        cache = self.blocks.cache
        if cache is None:
            return [], [[] for _ in self.windows]
        hashes = block_hashes(token_ids[:-1], self.block_size, root)
        first = cache.match(hashes)
        found = [[cache.get(group_name(h, g)) for h in hashes[: len(first)]] for g in range(1, len(self.windows) + 1)]
        # last_miss[g][j]: the last block at or before j that group g lacks, -1 if none.
        last_miss = []
        for blocks in found:
            miss, row = -1, []
            for j, b in enumerate(blocks):
                miss = j if b is None else miss
                row.append(miss)
            last_miss.append(row)
        n = len(first)
        while n > 0 and any(row[n - 1] >= first_needed(w, n * self.block_size, self.block_size)
                            for w, row in zip(self.windows, last_miss)):
            n -= 1
        cache.hit_blocks -= len(first) - n
        lists = []
        for w, blocks in zip(self.windows, found):
            lo = first_needed(w, n * self.block_size, self.block_size)
            lists.append([NULL_BLOCK] * lo + blocks[lo:n])
        cache.touch(group_name(hashes[j], g) for g, ids in enumerate(lists, 1) for j, b in enumerate(ids)
                    if b != NULL_BLOCK)
        return first[:n], lists

    def num_to_admit(self, lists: list[list[int]], num_tokens: int) -> int:
        """Blocks these groups take for a sequence admitted with lists (match_prefix's) to hold num_tokens."""
        return sum(-(-num_tokens // self.block_size) - len(ids) for ids in lists)

    def admit(self, seq: Sequence, lists: list[list[int]], num_tokens: int) -> None:
        """seq's lists: the reused ones (a reference on each block), then fresh blocks up to num_tokens."""
        self.blocks.share(self.held(lists))
        seq.group_block_ids = [list(ids) for ids in lists]
        for ids in seq.group_block_ids:
            ids.extend(self.blocks.allocate(-(-num_tokens // self.block_size) - len(ids)))

    def cache_full_blocks(self, seq: Sequence, num_cached: int, full: int) -> None:
        """Name these groups' blocks num_cached .. full - 1 (full and computed; seq.block_hashes names
        them already)."""
        cache = self.blocks.cache
        if cache is None or full <= num_cached:
            return
        self.blocks.share([ids[j] for g, ids in enumerate(self.lists(seq), 1) for j in range(num_cached, full)
                           if ids[j] != NULL_BLOCK and cache.insert(group_name(seq.block_hashes[j], g), ids[j])])

    # Swap preemption: the blocks a sequence holds in these groups travel after the first group's.

    def swap_ids(self, seq: Sequence, num_blocks: int) -> list[int]:
        """After remove_skipped: the blocks holding seq's first num_blocks blocks' K/V in these groups."""
        return [b for ids in self.lists(seq) for b in ids[:num_blocks] if b != NULL_BLOCK]

    def num_to_restore(self, seq: Sequence, num_blocks: int) -> int:
        """Blocks these groups take to hold num_blocks blocks again, for a sequence swapped out."""
        return sum(num_blocks - first_needed(w, seq.num_computed_tokens, self.block_size) for w in self.windows)

    def restore(self, seq: Sequence, num_blocks: int, swapped: int) -> list[int]:
        """Fresh blocks for these groups' num_blocks blocks (NULL_BLOCK below a window); returns the
        ones the first `swapped` blocks' K/V go back into, in swap_ids' order."""
        seq.group_block_ids, written = [], []
        for w in self.windows:
            lo = first_needed(w, seq.num_computed_tokens, self.block_size)
            ids = [NULL_BLOCK] * lo + self.blocks.allocate(num_blocks - lo)
            seq.group_block_ids.append(ids)
            written += ids[lo:swapped]
        return written
