"""Layer groups of the KV cache: which page table each layer reads and which page array it writes.

A model whose layers all attend alike has one group: every layer has an array of pages of its own,
all read through one page table. A model that mixes full and sliding-window attention (Gemma 2 and 3)
splits its layers into groups of equal size, one kind of attention in each, as vLLM's hybrid KV-cache
manager does (kv_cache_utils.py): every group has a page table of its own, drawn from one block pool,
and the cache holds `group_size` page arrays, array t shared by layer t of every group. A block id is
then a block of one group, holding that group's layers; a sliding group frees the blocks its window
has passed while a full group keeps them (paged_jax/core/window_blocks.py), so the pool spends on a
sliding layer only its window.

Gemma 3's pattern, 5 sliding layers to 1 full, makes groups of its full layers' count: the 270M's 18
layers are one full group of 3 and five sliding groups of 3, over 3 page arrays.
"""

import dataclasses

from models.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class KVGroups:
    """layers[g]: the layers of group g, ascending, in the order of the page arrays they use;
    windows[g]: the sliding window of the group's layers, behind which its blocks are freed, or None:
    its blocks are kept (full attention, and the one group of a model whose layers do not mix kinds).
    Group 0 keeps its blocks, so a sequence's first page table covers its whole context."""

    layers: tuple[tuple[int, ...], ...]
    windows: tuple[int | None, ...]

    @property
    def num_groups(self) -> int:
        return len(self.layers)

    @property
    def num_arrays(self) -> int:
        """Page arrays the cache holds (K and V each): the largest group's layers."""
        return max(len(group) for group in self.layers)

    def slot(self, layer: int) -> tuple[int, int]:
        """(group, page array) of a layer."""
        for g, group in enumerate(self.layers):
            if layer in group:
                return g, group.index(layer)
        raise ValueError(f"layer {layer} is in no group")


def one_group(config: ModelConfig) -> KVGroups:
    """Every layer in one group, each with a page array of its own: the cache as it was before groups."""
    return KVGroups((tuple(range(config.num_layers)),), (None,))


def kv_groups(config: ModelConfig, hybrid: bool = True) -> KVGroups:
    """The model's layer groups: one unless its layers mix attention kinds (and hybrid is asked for).

    Layers of one kind (one window, or full) are cut in runs of the smallest kind's count, in layer
    order; a kind whose count is not a multiple of it ends with a smaller group (its blocks then leave
    the page arrays it does not use unwritten)."""
    kinds: dict[int | None, list[int]] = {}
    for i in range(config.num_layers):
        kinds.setdefault(config.window(i), []).append(i)
    if not hybrid or len(kinds) == 1 or None not in kinds:
        return one_group(config)
    size = min(len(layers) for layers in kinds.values())
    ordered = [None, *sorted(w for w in kinds if w is not None)]  # full attention first: group 0
    groups = [(tuple(kinds[w][i : i + size]), w) for w in ordered for i in range(0, len(kinds[w]), size)]
    return KVGroups(tuple(layers for layers, _ in groups), tuple(w for _, w in groups))
