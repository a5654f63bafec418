"""packing.py: a pytree of host arrays through one buffer and back, bit for bit, inside a jit."""

import functools

import jax
import numpy as np

from paged_jax.core import packing
from paged_jax.core.sampling_tensors import make_sampling_tensors
from paged_jax.core.sampling_params import SamplingParams


def roundtrip(tree):
    buffer, layout = packing.pack(tree)
    assert buffer.dtype == np.int32 and buffer.ndim == 1
    return jax.jit(functools.partial(packing.unpack, layout=layout))(buffer)


def test_every_leaf_comes_back_with_its_shape_dtype_and_bits():
    rng = np.random.default_rng(0)
    tree = {"f": rng.standard_normal((3, 5)).astype(np.float32), "i": rng.integers(-9, 9, 7, dtype=np.int32),
            "u": rng.integers(0, 2**32, (2, 4), dtype=np.uint32), "b": np.bool_(True), "empty": np.zeros((4, 0), np.int32),
            "nan": np.array([np.nan, -0.0, np.inf], np.float32)}
    back = roundtrip(tree)
    for key, value in tree.items():
        got = np.asarray(back[key])
        assert got.dtype == np.asarray(value).dtype and got.shape == np.shape(value), key
        np.testing.assert_array_equal(got.view(np.uint8), np.asarray(value).view(np.uint8), err_msg=key)


def test_the_sampler_tensors_survive_and_one_shape_is_one_layout():
    def tensors(temperature):
        return make_sampling_tensors([SamplingParams(temperature=temperature, repetition_penalty=1.2)] * 3, [1, 2, 3],
                                     [[5, 6]] * 3, [[7]] * 3, [0], pad_rows_to=4, vocab_size=64, history_width=8)
    a, b = tensors(0.5), tensors(0.9)
    assert packing.pack(a)[1] == packing.pack(b)[1]  # a static argument: no compile per step
    back = roundtrip(a)
    for x, y in zip(jax.tree.leaves(back), jax.tree.leaves(a), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_a_64_bit_leaf_is_refused():
    try:
        packing.pack({"x": np.zeros(2, np.int64)})
    except ValueError as e:
        assert "int64" in str(e)
    else:
        raise AssertionError("packed an int64 array")
