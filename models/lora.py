"""LoRA adapters on the device: fixed slots of low-rank weights, and the delta they add to each
projection of a flat batch whose rows may each use a different adapter.

Slot s in [0, max_loras] names what a row runs with: 0 the base model alone, s >= 1 the adapter loaded
into slot s. Only slots 1..max_loras are held (slot 0's weights would be zeros), every adapter padded
with zeros to max_rank (which changes no product), its scale (alpha / r, or alpha / sqrt(r) under
rsLoRA) folded into B. Loading an adapter is one jitted, donated update of fixed shapes (`load_into`) of
every layer at once from a few stacked host arrays (`host_slot`), compiled once whatever the adapter.

The delta follows Punica's BGMV in spirit, every row at once, but without gathering a copy of the
weights per row (a 512-token prefill would copy them 512 times): each projection's A of every slot is
one matrix, x @ A_all gives every slot's rank-r activations, a one-hot of each row's slot keeps its own
and zeroes the others, and that times B_all (every slot's B stacked on the rank axis) is the delta. Two
dense matmuls whose weights are read once per step; their work grows with max_loras, not with how many
adapters the step uses. Zeros add exactly, so a row's delta is its own adapter's, to rounding.

Projections that share an input share one A matmul: q/k/v (the fused qkv of layers.Attention) and
gate/up (layers.MLP's gate_up); each part keeps its own B, so nothing block-diagonal is multiplied.

Beside a model packed for the C++ CPU matmul, the slots are packed too (lora_packed.PackedProjection,
with LoRAProjection's methods), and a step of few rows adds B's product inside the base matmul's pass.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from models.config import ModelConfig
from models.lora_packed import PackedProjection, kv_heads_of, panel_parts

# The fused projections of a layer and the Hugging Face modules each one computes, in its output order.
GROUPS: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}
TARGETS = tuple(m for modules in GROUPS.values() for m in modules)


def module_shape(config: ModelConfig, module: str) -> tuple[int, int]:
    """(in, out) features of a Hugging Face projection of this config."""
    c = config
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    return {"q_proj": (c.hidden_size, q), "k_proj": (c.hidden_size, kv), "v_proj": (c.hidden_size, kv),
            "o_proj": (q, c.hidden_size), "gate_proj": (c.hidden_size, c.intermediate_size),
            "up_proj": (c.hidden_size, c.intermediate_size), "down_proj": (c.intermediate_size, c.hidden_size)}[module]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LoRAProjection:
    """Every slot's adapter for one fused projection of one layer, in XLA's layout (lora_packed.py has the
    C++ matmul's).

    a: [in, max_loras, parts, max_rank], each part's A (x @ a[:, s, p] is part p's rank activations).
    b: one [max_loras, max_rank, out_p] per part, scale folded in.
    """

    a: jax.Array
    b: tuple[jax.Array, ...]

    @property
    def slots(self) -> int:
        return self.a.shape[1]

    def take(self, index: jax.Array) -> "LoRAProjection":
        """The slots index (int32 [U], 0-based) alone, in their order."""
        return LoRAProjection(jnp.take(self.a, index, axis=1), tuple(jnp.take(b, index, axis=0) for b in self.b))

    def put(self, a: jax.Array, b: list[jax.Array], scale: jax.Array, index: jax.Array) -> "LoRAProjection":
        """Slot index (int32 scalar, 0-based) holding a: float32 [parts, max_rank, in] and b: each part's
        float32 [out_p, max_rank], as PEFT stores them; B scaled by scale in float32, then cast."""
        a = jnp.transpose(a, (2, 0, 1)).astype(self.a.dtype)  # [in, parts, max_rank]
        return LoRAProjection(jax.lax.dynamic_update_index_in_dim(self.a, a, index, axis=1), tuple(
            jax.lax.dynamic_update_index_in_dim(old, (part * scale).T.astype(old.dtype), index, axis=0)
            for old, part in zip(self.b, b, strict=True)))

    def addend(self, x: jax.Array, onehot: jax.Array, index: jax.Array, rows) -> None:
        """None: this layout's delta is `delta`'s, per part (lora_packed.PackedProjection's is an addend to
        the base matmul, whole)."""

    def delta(self, x: jax.Array, onehot: jax.Array, rows=None) -> tuple[jax.Array, ...]:
        """x: [num_tokens, in]; onehot: [num_tokens, max_loras] in x's dtype, row t's slot s >= 1 at s - 1
        (all zeros: the base model); rows: int32 scalar, the leading rows that are real tokens, or None: all
        (packed slots skip the rest). Returns each part's delta [num_tokens, out_p]."""
        k, n, parts, r = self.a.shape
        h = jnp.dot(x, self.a.reshape(k, n * parts * r)).reshape(-1, n, parts, r) * onehot[:, :, None, None]
        return tuple(jnp.dot(h[:, :, p].reshape(-1, n * r), b.reshape(n * r, -1)) for p, b in enumerate(self.b))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerLoRA:
    """What one decoder layer's projections take: their slots' weights, and each row's slot as a one-hot
    (XLA's dots) and as an index (the packed slots' C++ kernel)."""

    projections: dict[str, LoRAProjection]  # GROUPS' names
    onehot: jax.Array  # [num_tokens, max_loras], the activations' dtype
    index: jax.Array  # int32 [num_tokens], LoRARows.index

    def addend(self, group: str, x: jax.Array, rows=None) -> tuple | None:
        """What projection `group`'s base matmul adds (layers.linear's `add`: a lora_packed.SlotAddend or
        DenseAddend) for its input x [num_tokens, in], or None (XLA-layout slots): then add `delta`'s."""
        return self.projections[group].addend(x, self.onehot, self.index, rows)

    def delta(self, group: str, x: jax.Array, rows=None) -> tuple[jax.Array, ...]:
        """The delta of projection `group` (a GROUPS name) on its input x [num_tokens, in], one per part;
        rows as LoRAProjection.delta's."""
        return self.projections[group].delta(x, self.onehot, rows)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LoRARows:
    """Which adapter each row of a flat batch runs with.

    slots: int32 [U], the slots the rows use (1..max_loras; 0 pads). U == max_loras means every slot in
        order (1, 2, ..., max_loras) and the weights are used as they are; a smaller U (a step whose rows
        use one adapter) gathers those slots' weights first, and the delta's work shrinks to U slots.
    index: int32 [num_tokens], each row's place in slots, or -1: the base model alone.
    """

    slots: jax.Array
    index: jax.Array

    @staticmethod
    def every_slot(row_slots: jax.Array, max_loras: int) -> "LoRARows":
        """The rows of row_slots (int32 [num_tokens], each row's slot, 0: none) over every slot."""
        return LoRARows(jnp.arange(1, max_loras + 1, dtype=jnp.int32), row_slots - 1)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LoRAWeights:
    """Every layer's slots: layers[i][group] is layer i's LoRAProjection of that GROUPS name."""

    layers: tuple[dict[str, LoRAProjection | PackedProjection], ...]

    @property
    def max_loras(self) -> int:
        return self.layers[0]["o"].slots

    def for_step(self, rows: LoRARows, dtype) -> tuple[LayerLoRA, ...]:
        """Each layer's LayerLoRA for a step whose rows are `rows`, its one-hot in dtype."""
        used = rows.slots.shape[0]
        onehot = (rows.index[:, None] == jnp.arange(used)).astype(dtype)
        by_layer = self.layers
        if used != self.max_loras:
            index = jnp.maximum(rows.slots - 1, 0)
            by_layer = tuple({g: p.take(index) for g, p in layer.items()} for layer in by_layer)
        return tuple(LayerLoRA(projections, onehot, rows.index) for projections in by_layer)


def _projection(config: ModelConfig, group: str, max_loras: int, rank: int, dtype, packed: bool):
    """Empty slots (zeros) of one fused projection, in either layout."""
    modules = GROUPS[group]
    fan_in, out = module_shape(config, modules[0])[0], tuple(module_shape(config, m)[1] for m in modules)
    if packed:
        return PackedProjection.empty(fan_in, out, kv_heads_of(config, group), max_loras, rank)
    return LoRAProjection(jnp.zeros((fan_in, max_loras, len(modules), rank), dtype),
                          tuple(jnp.zeros((max_loras, rank, o), dtype) for o in out))


def packable(config: ModelConfig, dtype) -> bool:
    """Whether slots for this config can be packed (lora_packed.py): float32, and no output panel of a fused
    projection spans two of its parts."""
    return jnp.dtype(dtype) == jnp.float32 and all(
        panel_parts(tuple(module_shape(config, m)[1] for m in names), kv_heads_of(config, g)) is not None
        for g, names in GROUPS.items())


def empty(config: ModelConfig, max_loras: int, max_rank: int, dtype=jnp.float32, packed: bool = False) -> LoRAWeights:
    """max_loras empty slots (zeros) of rank max_rank for every layer and projection of this config; packed:
    in the C++ matmul's layout (lora_packed.py), for a model packed for it, where `packable`."""
    if max_loras < 1 or max_rank < 1:
        raise ValueError(f"max_loras ({max_loras}) and max_lora_rank ({max_rank}) must be at least 1")
    if packed and not packable(config, dtype):
        raise ValueError(f"LoRA slots of {jnp.dtype(dtype).name} for this model cannot be packed")
    return LoRAWeights(tuple({g: _projection(config, g, max_loras, max_rank, dtype, packed) for g in GROUPS}
                             for _ in range(config.num_layers)))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class HostAdapter:
    """One adapter on the host, what `load_into` takes: every layer's tensors stacked, as PEFT stores them
    (torch's Linear layout, unscaled), zero-padded to max_rank; a module not given is zeros.

    a: per GROUPS name, float32 [num_layers, parts, max_rank, in], each part's A.
    b: per GROUPS name, one float32 [num_layers, out_p, max_rank] per part, each part's B.
    scale: float32 [], what B is multiplied by.
    """

    a: dict[str, np.ndarray]
    b: dict[str, tuple[np.ndarray, ...]]
    scale: np.ndarray


# Each Hugging Face module's GROUPS name and its part in it.
_PLACES = {name: (group, p) for group, names in GROUPS.items() for p, name in enumerate(names)}


def host_slot(config: ModelConfig, max_rank: int, modules: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]],
              scale: float) -> HostAdapter:
    """One adapter's host arrays for `load_into`. modules: (layer, Hugging Face module name) -> (A [r, in],
    B [out, r]) as PEFT stores them, r <= max_rank. Only copies of whole rows: the transposes, the scale
    and the cast to the slots' dtype are load_into's, on the device."""
    num_layers = config.num_layers
    a = {g: np.zeros((num_layers, len(names), max_rank, module_shape(config, names[0])[0]), np.float32)
         for g, names in GROUPS.items()}
    b = {g: tuple(np.zeros((num_layers, module_shape(config, n)[1], max_rank), np.float32) for n in names)
         for g, names in GROUPS.items()}
    for (i, name), (lora_a, lora_b) in modules.items():
        group, p = _PLACES[name]
        r = lora_a.shape[0]
        a[group][i, p, :r] = lora_a
        b[group][p][i, :, :r] = lora_b
    return HostAdapter(a, b, np.float32(scale))


@functools.partial(jax.jit, donate_argnums=0)
def load_into(weights: LoRAWeights, slot: jax.Array, adapter: HostAdapter) -> LoRAWeights:
    """weights with slot `slot` (int32 scalar, 1..max_loras) holding `adapter` (host_slot's; zeros free the
    slot). weights is donated: the update is in place. One program for every adapter and slot. B is scaled
    in float32 before the cast to the slots' dtype."""
    return LoRAWeights(tuple(
        {g: p.put(adapter.a[g][i], [part[i] for part in adapter.b[g]], adapter.scale, slot - 1)
         for g, p in layer.items()}
        for i, layer in enumerate(weights.layers)))
