"""models/sharding.py on the host: when KV heads are copied, how, and which meshes are refused."""

import dataclasses

import numpy as np
import pytest

from models import sharding
from models.tiny import TINY_LLAMA


@pytest.mark.parametrize("heads, kv_heads, size, replicas", [
    (8, 2, 2, 1), (8, 2, 4, 2), (8, 2, 8, 4), (9, 3, 3, 1), (8, 8, 4, 1), (6, 2, 1, 1),
])
def test_kv_head_replicas(heads, kv_heads, size, replicas):
    config = dataclasses.replace(TINY_LLAMA, num_heads=heads, num_kv_heads=kv_heads)
    assert sharding.kv_head_replicas(config, size) == replicas
    assert sharding.with_kv_replicas(config, replicas).num_kv_heads == kv_heads * replicas


@pytest.mark.parametrize("heads, kv_heads, size, message", [
    (6, 2, 4, "divide the model's 6 query heads"),
    (12, 3, 2, "must divide the model's 3 KV heads or be a multiple"),
])
def test_meshes_that_cannot_split_the_heads_are_refused(heads, kv_heads, size, message):
    config = dataclasses.replace(TINY_LLAMA, num_heads=heads, num_kv_heads=kv_heads)
    with pytest.raises(ValueError, match=message):
        sharding.kv_head_replicas(config, size)


def test_copied_kv_heads_keep_the_query_heads_in_order():
    """[hidden, kv, group + 2, dim] with 2 KV heads of 4 query heads each, copied twice: each copy has 2
    of its head's query heads, in order, and the head's own k and v."""
    hidden, kv, group, dim = 3, 2, 4, 5
    qkv = np.random.default_rng(0).normal(size=(hidden, kv, group + 2, dim))
    out = sharding.replicate_kv_heads(qkv, 2)
    assert out.shape == (hidden, 4, 4, dim)
    q_in = qkv[:, :, :group].reshape(hidden, kv * group, dim)
    q_out = out[:, :, :2].reshape(hidden, kv * group, dim)
    np.testing.assert_array_equal(q_out, q_in)
    for copy in range(4):
        np.testing.assert_array_equal(out[:, copy, 2:], qkv[:, copy // 2, group:])
    bias = qkv[0]  # [kv, group + 2, dim], as qkv_bias is
    np.testing.assert_array_equal(sharding.replicate_kv_heads(bias, 2), out[0])
