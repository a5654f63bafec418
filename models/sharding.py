"""Tensor parallelism: the one place that knows how the model's arrays are laid out over a device mesh.

Megatron-style over the mesh axis TP_AXIS ("model"), as each Param's `out_sharding` says (llama.py):
q/k/v and gate/up are split over their output heads / intermediate dimension (column-parallel), o and
down over their input dimension (row-parallel, so each ends in one all-reduce), the embedding over the
vocabulary. The KV cache is split over KV heads, and each device's attention reads only its own heads'
pages: `per_kv_head` runs the cache write and the attention kernel under `shard_map`, where every
backend sees the local arrays it was written for. The block pool, page tables and scheduler are the
host's and know nothing of this: sharding is a property of the arrays.

Lives in `models` (not the engine) because the model's forward pass needs `per_kv_head`; the engine
builds the mesh (`make_mesh`) and hands it to the loader and the step.
"""

import dataclasses
from collections.abc import Callable

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from kernels_pallas import layout as kv_layout
from models.config import ModelConfig

TP_AXIS = "model"  # the mesh axis tensor parallelism splits weights over

# Per-token q/k/v [num_tokens, heads, head_dim], split over their head axis.
HEADS = P(None, TP_AXIS, None)


def make_mesh(size: int, devices: list | None = None) -> Mesh:
    """A one-axis mesh (TP_AXIS) over the first `size` of `devices` (default: jax.devices())."""
    devices = jax.devices() if devices is None else devices
    if size > len(devices):
        raise ValueError(f"tensor_parallel_size {size} needs {size} devices; JAX sees {len(devices)}")
    return Mesh(np.asarray(devices[:size]), (TP_AXIS,))


def kv_head_replicas(config: ModelConfig, size: int) -> int:
    """How many copies of each KV head the mesh holds: 1 when `size` divides the KV heads.

    When it does not (SmolLM2 has 3 KV heads), each KV head is copied onto size // num_kv_heads
    devices, each of which keeps its share of that head's query heads, as vLLM does: splitting one
    KV head's head_dim across devices would need a collective inside attention, and copying a few
    KV heads costs only their weights and cache. So `size` must divide the query heads and be a
    multiple of the KV heads.
    """
    if config.num_heads % size:
        raise ValueError(f"tensor_parallel_size {size} must divide the model's {config.num_heads} query heads")
    if config.num_kv_heads % size == 0:
        return 1
    if size % config.num_kv_heads:
        raise ValueError(f"tensor_parallel_size {size} must divide the model's {config.num_kv_heads} KV heads "
                         f"or be a multiple of them")
    return size // config.num_kv_heads


def with_kv_replicas(config: ModelConfig, replicas: int) -> ModelConfig:
    """The config the engine runs: each KV head counted `replicas` times (query heads unchanged)."""
    return dataclasses.replace(config, num_kv_heads=config.num_kv_heads * replicas)


def replicate_kv_heads(qkv: np.ndarray, replicas: int) -> np.ndarray:
    """[..., num_kv_heads, group + 2, head_dim] -> [..., num_kv_heads * replicas, group / replicas + 2, head_dim].

    Copy r of KV head j carries query heads r * group / replicas onwards of that head's group and the
    head's k and v; the query heads keep their order, so the o projection is unchanged.
    """
    if replicas == 1:
        return qkv
    *lead, kv, width, dim = qkv.shape
    group = width - 2
    q = qkv[..., :group, :].reshape(*lead, kv, replicas, group // replicas, dim)
    k_v = np.broadcast_to(qkv[..., None, group:, :], (*lead, kv, replicas, 2, dim))
    return np.concatenate([q, k_v], axis=-2).reshape(*lead, kv * replicas, group // replicas + 2, dim)


def param_sharding(mesh: Mesh, spec: tuple, shape: tuple[int, ...]) -> NamedSharding:
    """The NamedSharding of a parameter of `shape` whose Param says `spec`. A dimension the mesh does
    not divide (a vocabulary of odd size) is replicated instead: every shard must be the same size."""
    size = mesh.shape[TP_AXIS]
    fitted = [axis if axis is None or dim % size == 0 else None for axis, dim in zip(spec, shape)]
    return NamedSharding(mesh, P(*fitted))


def pages_spec(layout: str) -> P:
    """Pages in `layout` (kernels_pallas/layout.py) split over their KV-head axis.

    No trailing None: that is how the compiled step writes the spec of the cache it returns, and
    NamedSharding(P(a, None)) != NamedSharding(P(a)), so a cache made with the longer spec would
    compile every program a second time on its second call.
    """
    return P(*[None] * kv_layout.head_axis(layout), TP_AXIS)


def pages_sharding(mesh: Mesh, layout: str) -> NamedSharding:
    return NamedSharding(mesh, pages_spec(layout))


def shard_map(fn: Callable, mesh: Mesh, in_specs, out_specs) -> Callable:
    """jax.shard_map where this JAX has it, else jax.experimental's. Replication is not checked: the
    attention kernels (FFI and Pallas calls) have no replication rule, and every output is split."""
    if hasattr(jax, "shard_map"):
        return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
    from jax.experimental.shard_map import shard_map as experimental

    return experimental(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_rep=False)


def per_kv_head(fn: Callable, mesh: Mesh | None, layout: str) -> Callable:
    """`fn(q, k, v, k_pages, v_pages, metadata) -> (out, k_pages, v_pages)` run on each device over
    its own KV heads (and their query heads), or as it is without a mesh.

    q, out: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim];
    pages: in `layout`, split over their KV-head axis; metadata (an AttentionMetadata) is
    replicated: every device walks the same block tables over its own slice of each page.
    """
    if mesh is None:
        return fn
    pages = pages_spec(layout)
    return shard_map(fn, mesh, in_specs=(HEADS, HEADS, HEADS, pages, pages, P()), out_specs=(HEADS, pages, pages))
