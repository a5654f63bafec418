"""A step's host arrays in one buffer, so they reach the device in one transfer.

A step's inputs are two pytrees of small numpy arrays (the flat batch, batch.py; the sampler's rows,
sampling.py), 26 arrays in all. Handed to a jitted call as they are, each is a transfer of its own:
55 us apiece on the CPU for arrays of a few hundred bytes, against 48 us for one buffer of 800 kB, and
on a GPU each is a host-to-device copy with its own fixed cost. `pack` lays a pytree's leaves end to
end as 32-bit words; the jitted call takes the buffer and its `Layout` (a static argument: it is the
same for every step of one shape, so it costs no compile) and `unpack`s it on the device, where
slicing and bit-casting are free.
"""

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

_WORD = np.dtype(np.int32)


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where each leaf of a packed pytree lies in its buffer: hashable, a static argument of a jit."""

    treedef: Any
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]  # float32, int32, uint32 or bool

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(int(np.prod(shape)) for shape in self.shapes)


def pack(tree) -> tuple[np.ndarray, Layout]:
    """tree: a pytree of numpy arrays (or scalars) of 32-bit or bool dtypes -> (int32 [words], its Layout)."""
    leaves, treedef = jax.tree.flatten(tree)
    arrays = [np.asarray(x) for x in leaves]
    for a in arrays:
        if a.dtype != np.bool_ and a.dtype.itemsize != 4:
            raise ValueError(f"pack takes 32-bit and bool arrays, not {a.dtype}")
    words = [a.astype(_WORD) if a.dtype == np.bool_ else a.view(_WORD) for a in arrays]
    buffer = np.concatenate([w.reshape(-1) for w in words]) if words else np.zeros(0, _WORD)
    return buffer, Layout(treedef, tuple(a.shape for a in arrays), tuple(a.dtype.name for a in arrays))


def unpack(buffer: jax.Array, layout: Layout):
    """The pytree `pack` made buffer (int32 [words]) from, as jax arrays; for use inside a jit."""
    leaves, start = [], 0
    for shape, dtype, size in zip(layout.shapes, layout.dtypes, layout.sizes):
        words = buffer[start : start + size].reshape(shape)
        start += size
        if dtype == "bool":
            leaves.append(words != 0)
        elif dtype == "int32":
            leaves.append(words)
        else:
            leaves.append(jax.lax.bitcast_convert_type(words, jnp.dtype(dtype)))
    return jax.tree.unflatten(layout.treedef, leaves)
