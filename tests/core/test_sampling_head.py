"""sampling.sample_head: the sampler over a model's head, which takes a greedy step's tokens from the
fused greedy head (models/decoder.py: greedy_tokens, linear.cc's ArgmaxLinearF32) where nothing else of
the logits is needed, and gives exactly what `sample` over the logits gives, in every kind of step."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.cpu import kernel as cpu_kernel
from models.tiny import TINY_GEMMA3, TINY_LLAMA, random_model
from paged_jax.core.sampling import sample, sample_head
from paged_jax.core.sampling_params import SamplingParams
from sampler_rows import build

pytestmark = pytest.mark.skipif(not cpu_kernel.available(), reason=str(cpu_kernel.build_error()))

VOCAB = 1000  # not a multiple of the 16-column panel; within sampler_rows' ban mask
GREEDY = SamplingParams(temperature=0.0)
STEPS = {  # one step's rows, and whether the fused head may take its tokens
    "greedy": ([GREEDY] * 5, True),
    "greedy, padded": ([GREEDY] * 3, True),
    "a row asks for logprobs": ([GREEDY, SamplingParams(temperature=0.0, logprobs=2)], False),
    "a row bans EOS": ([GREEDY, SamplingParams(temperature=0.0, min_tokens=4)], False),
    "a row has penalties": ([GREEDY, SamplingParams(temperature=0.0, repetition_penalty=1.3)], False),
    "a row draws": ([GREEDY, SamplingParams(temperature=1.0, seed=5)], False),
}


def _tensors(name):
    params, _ = STEPS[name]
    return build(params, outputs=[[1, 2]] * len(params), pad_rows_to=8 if "padded" in name else None)


class _Marked:
    """A head whose greedy_tokens give -1: shows which steps take them."""

    greedy_head = True

    def __init__(self, model):
        self.model = model

    def logits(self, x, num_rows=None):
        return self.model.logits(x, num_rows)

    def greedy_tokens(self, x, num_rows=None):
        return jnp.full(x.shape[0], -1, jnp.int32)


@pytest.fixture(scope="module")
def packed():
    return random_model(dataclasses.replace(TINY_LLAMA, vocab_size=VOCAB)).pack_for_cpu()


@pytest.mark.parametrize("name", list(STEPS))
def test_every_step_samples_what_sample_over_the_logits_does(packed, name):
    t = _tensors(name)
    x = jnp.asarray(np.random.default_rng(len(name)).standard_normal((t.temperature.shape[0], 64)), jnp.float32)
    got = jax.jit(sample_head, static_argnums=0)(packed, x, t)
    want = jax.jit(lambda x, t: sample(packed.logits(x, t.num_rows), t))(x, t)
    for field in ("tokens", "logprobs", "top_logprobs", "top_ids"):
        np.testing.assert_array_equal(getattr(got, field), getattr(want, field), err_msg=field)
    marked = np.asarray(jax.jit(sample_head, static_argnums=0)(_Marked(packed), x, t).tokens)
    assert (marked == -1).all() == STEPS[name][1]


def test_the_fused_head_only_where_its_tokens_are_the_logits_argmax():
    """Packed float32 heads fuse, tied embeddings included; an unpacked head, an int8 one and a soft-capped
    one (cap * tanh(l / cap) can round two logits to one value) do not."""
    tied = dataclasses.replace(TINY_GEMMA3, vocab_size=VOCAB, final_logit_softcapping=None)
    model = random_model(tied).pack_for_cpu()
    assert model.greedy_head
    x = jnp.asarray(np.random.default_rng(0).standard_normal((9, 64)), jnp.float32)
    np.testing.assert_array_equal(model.greedy_tokens(x, jnp.int32(7)),
                                  jnp.argmax(model.logits(x, jnp.int32(7)), axis=-1))
    assert not random_model(tied).greedy_head
    assert not random_model(tied).pack_for_cpu("int8").greedy_head
    assert not random_model(dataclasses.replace(tied, final_logit_softcapping=5.0)).pack_for_cpu().greedy_head
