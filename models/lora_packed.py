"""LoRA slots in the C++ CPU matmul's layout, beside a model packed for it (decoder.pack_for_cpu).

A decode step's deltas were hundreds of small XLA dots, each repacking its weight on every call (1.41x
the base step on the Xeon 6/207, scripts/bench_lora.py). Packed like the base weights, a fused
projection's delta is one C++ call (kernels_pallas/cpu/lora.cc, lora_cpu) after the unchanged base
matmul, adding in place each row's x @ A @ B of its own slot (the kernel picks the slot: no mask in XLA).
B is laid out in the fused projection's output order (layers.py: q/k/v interleaved per KV head, gate
then up), each panel of PANEL columns within one part, so nothing block-diagonal is multiplied. Steps of
PACKED_MAX_ROWS rows and more (prefill) take XLA's dots over an unpacked copy instead, faster there, B's
product in one dot whose output is in the fused order.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from kernels_pallas import cpu_kernel
from kernels_pallas.cpu.packing import PANEL, pack_columns
from models.config import ModelConfig

# Fewer rows than this: the C++ kernel (at 16 rows, decode, 1.41x -> about 1.2x); more: XLA's dot over an
# unpacked copy (at 512 rows, prefill, the faster by some 5%: linear.cc leaves its FMA tiles for the tile
# unit from 64 rows). scripts/bench_lora.py, loaded Xeon 6/207.
PACKED_MAX_ROWS = 64


def fuse(parts: list, kv_heads: int):
    """Each part's [rows, out_p] side by side as a fused projection orders its output columns in layers.py:
    kv_heads 0, in order (gate then up; one part); else q/k/v per KV head ([kv_heads, group_size + 2,
    head_dim], layers.Attention's qkv). numpy or jax arrays."""
    xp = jnp if isinstance(parts[0], jax.Array) else np
    if not kv_heads:
        return xp.concatenate(parts, axis=1)
    head_dim = parts[1].shape[1] // kv_heads
    q, k, v = (p.reshape(p.shape[0], kv_heads, -1, head_dim) for p in parts)
    return xp.concatenate([q, k, v], axis=2).reshape(parts[0].shape[0], -1)


def kv_heads_of(config: ModelConfig, group: str) -> int:
    """fuse's kv_heads for the fused projection `group` (models.lora.GROUPS) of this config."""
    return config.num_kv_heads if group == "qkv" else 0


def panel_parts(out: tuple[int, ...], kv_heads: int) -> tuple[int, ...] | None:
    """Each output panel's part in a fused projection (fuse's), or None where a panel would span two parts."""
    columns = fuse([np.full((1, o), p) for p, o in enumerate(out)], kv_heads)[0]
    panels = [columns[i: i + PANEL] for i in range(0, len(columns), PANEL)]
    return None if any((p != p[0]).any() for p in panels) else tuple(int(p[0]) for p in panels)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PackedProjection:
    """Every slot's adapter for one fused projection of one layer, float32, packed (lora.LoRAProjection's
    counterpart, with the same methods).

    a: [max_loras, ceil(parts * max_rank / PANEL), in, PANEL]: slot s's A as pack_columns of its
        [in, parts * max_rank] (part-major), slots apart so that one is loaded or gathered whole.
    b: [ceil(out / PANEL), max_loras, max_rank, PANEL]: pack_columns of [max_loras * max_rank, out], out
        the fused projection's columns (`fuse`), each panel's rows its part's B; scale folded in.
    out: static, each part's out_p; kv_heads: static, fuse's; parts: static, each panel's part (`panel_parts`).
    """

    a: jax.Array
    b: jax.Array
    out: tuple[int, ...] = dataclasses.field(metadata={"static": True})
    kv_heads: int = dataclasses.field(metadata={"static": True})
    parts: tuple[int, ...] = dataclasses.field(metadata={"static": True})

    @staticmethod
    def empty(fan_in: int, out: tuple[int, ...], kv_heads: int, max_loras: int, rank: int) -> "PackedProjection":
        """Empty slots (zeros); fan_in, out, kv_heads: the fused projection's (`panel_parts` not None)."""
        parts = panel_parts(out, kv_heads)
        a = jnp.zeros((max_loras, pl.cdiv(len(out) * rank, PANEL), fan_in, PANEL), jnp.float32)
        return PackedProjection(a, jnp.zeros((len(parts), max_loras, rank, PANEL), jnp.float32), out, kv_heads, parts)

    @property
    def slots(self) -> int:
        return self.a.shape[0]

    @property
    def rank(self) -> int:
        return self.b.shape[2]

    def take(self, index: jax.Array) -> "PackedProjection":
        """The slots index (int32 [U], 0-based) alone, in their order."""
        return dataclasses.replace(self, a=jnp.take(self.a, index, axis=0), b=jnp.take(self.b, index, axis=1))

    def put(self, a: jax.Array, b: list[jax.Array], scale: jax.Array, index: jax.Array) -> "PackedProjection":
        """Slot index (int32 scalar, 0-based) holding a: float32 [parts, max_rank, in] and b: each part's
        float32 [out_p, max_rank], as PEFT stores them; B scaled by scale."""
        a = pack_columns(a.reshape(-1, a.shape[-1]).T)
        b = pack_columns(fuse([(part * scale).T for part in b], self.kv_heads))  # [panels, max_rank, PANEL]
        return dataclasses.replace(self, a=jax.lax.dynamic_update_index_in_dim(self.a, a, index, axis=0),
                                   b=jax.lax.dynamic_update_index_in_dim(self.b, b, index, axis=1))

    def addend(self, x: jax.Array, onehot: jax.Array, index: jax.Array, rows) -> "SlotAddend | DenseAddend":
        """The delta as layers.linear adds it to the base matmul. x: [num_tokens, in]; onehot: [num_tokens,
        max_loras] float32, row t's slot s >= 1 at s - 1 (all zeros: the base model); index: int32
        [num_tokens], the same s - 1 (-1: the base model); rows: int32 scalar, the leading rows that are real
        tokens, or None: all.

        Fewer than PACKED_MAX_ROWS rows: by panels, the C++ kernel after the base matmul (lora_cpu picks each
        row's slot: no mask in XLA, no other slot's A or B multiplied). Else dense, XLA's
        dots over an unpacked copy: h [num_tokens, parts * max_loras * max_rank] (part-major) and B with
        each part's rows zero outside its own columns, so that one dot gives the delta in the fused
        projection's column order, with no per-part outputs to put together (a 512-row prefill's deltas
        are as large as its outputs)."""
        n, panels, k, _ = self.a.shape
        parts, r = len(self.out), self.rank
        if x.shape[0] < PACKED_MAX_ROWS:
            return SlotAddend(x, self.a, self.b, np.asarray(self.parts, np.int32), index, rows)
        a = self.a.transpose(2, 0, 1, 3).reshape(k, n * panels * PANEL)
        h = jnp.dot(x, a).reshape(-1, n, panels * PANEL)[:, :, : parts * r].reshape(-1, n, parts, r)
        h = (h * onehot[:, :, None, None]).transpose(0, 2, 1, 3)  # [num_tokens, parts, max_loras, max_rank]
        own = np.repeat(np.asarray(self.parts)[None, :] == np.arange(parts)[:, None], PANEL, axis=1)  # [parts, cols]
        b = self.b.transpose(1, 2, 0, 3).reshape(1, n * r, -1) * own[:, None, :]
        return DenseAddend(h.reshape(-1, parts * n * r), b.reshape(parts * n * r, -1)[:, : sum(self.out)])


@dataclasses.dataclass(frozen=True)
class SlotAddend:
    """A few rows' LoRA delta, added by the C++ kernel (lora_cpu) to a base matmul's output [num_tokens,
    out] float32, in place.

    x: float32 [num_tokens, in]; a [max_loras, panels, in, PANEL] and b [ceil(out / PANEL), max_loras,
    max_rank, PANEL]: PackedProjection's; groups: int32 [ceil(out / PANEL)], each panel's part; slot: int32
    [num_tokens], each row's (0-based; -1: none); rows: the leading real rows (int32 scalar or None: all).
    """

    x: jax.Array
    a: jax.Array
    b: jax.Array
    groups: np.ndarray
    slot: jax.Array
    rows: jax.Array | int | None = None

    def added_to(self, out: jax.Array) -> jax.Array:
        """out [num_tokens, out] plus this delta (out's buffer reused)."""
        return cpu_kernel.lora_cpu(out, self.x, self.a, self.b, self.groups, self.slot, self.rows)


@dataclasses.dataclass(frozen=True)
class DenseAddend:
    """Many rows' LoRA delta, h [num_tokens, depth] @ b [depth, out], added by XLA."""

    h: jax.Array
    b: jax.Array

    def added_to(self, out: jax.Array) -> jax.Array:
        """out [num_tokens, out] plus this delta."""
        return out + jnp.dot(self.h, self.b)
