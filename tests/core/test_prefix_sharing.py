"""Prefix caching through the engine on a tiny random model: a request reuses only KV computed after
the same beginning as its own, and decodes as it does alone."""

import numpy as np
import pytest

from models.tiny import TINY_LLAMA, random_model
from paged_jax import LLM, EngineConfig, LLMEngine, SamplingParams

BS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    return random_model(TINY_LLAMA)


def make_llm(model, **options) -> LLM:
    return LLM.from_engine(LLMEngine(model, TINY_LLAMA, None, EngineConfig(block_size=BS, num_blocks=64, **options)))


def test_the_same_block_after_another_beginning_is_not_reused(model):
    rng = np.random.default_rng(0)
    x, y, z, w = (rng.integers(0, TINY_LLAMA.vocab_size, BS).tolist() for _ in range(4))
    earlier = [x + y + [1, 2, 3], z + w + [4, 5]]  # they leave x, y (after x), z and w (after z) cached
    # y at the same position as in the first prompt, but after z: only z's block is its prefix.
    later = z + y + [6, 7, 8]
    alone = [o.outputs[0].token_ids for o in make_llm(model, enable_prefix_caching=False).generate(
        [*earlier, later], GREEDY, use_tqdm=False)]
    llm = make_llm(model)
    first = llm.generate(earlier, GREEDY, use_tqdm=False)
    (second,) = llm.generate([later], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in (*first, second)] == alone
    assert second.metrics.num_prefix_hit_tokens == BS
    engine = llm.engine
    engine.blocks.reset_prefix_cache()
    assert engine.blocks.num_free == engine.blocks.num_blocks - 1


def test_the_hit_counters_keep_counting_across_a_reset(model):
    """The stats' prefix-cache counters feed Prometheus counters: an emptied cache must not read as 0."""
    prompt = np.random.default_rng(1).integers(0, TINY_LLAMA.vocab_size, 3 * BS).tolist()
    llm = make_llm(model)
    for _ in range(2):
        llm.generate([prompt], GREEDY, use_tqdm=False)
    before = llm.engine.stats()
    assert before.prefix_cache_hit_blocks > 0
    llm.engine.blocks.reset_prefix_cache()
    after = llm.engine.stats()
    assert (after.prefix_cache_hit_blocks, after.prefix_cache_queried_blocks) == (
        before.prefix_cache_hit_blocks, before.prefix_cache_queried_blocks)
