"""Qwen3, Gemma 3, Gemma 2, Mistral past its window and the mixtures of experts (Qwen3-MoE, the odd one,
and Mixtral past a window) through the engine against transformers: greedy
tokens of tiny random checkpoints (conftest.TINY_ARCHS) with chunked prefill and prefix caching on, on
each CPU attention backend (and under preemption, recomputed or swapped), and on the Pallas kernel in
its interpreter for a small case. The Gemmas' windows and this Mistral's and Mixtral's (8) are shorter
than the prompts' shared prefix, so sliding layers drop keys in prefill chunks, from cached blocks, and in decode."""

import numpy as np
import pytest

from conftest import hf_greedy, make_tiny_model
from models import load_model
from models.kv_groups import kv_groups
from paged_jax import LLM, EngineConfig, LLMEngine, SamplingParams

STEPS = 16


@pytest.fixture(scope="module", params=("qwen3", "gemma3", "gemma2", "mistral-window8", "qwen3_moe", "qwen3_moe_odd",
                                        "mixtral-window8"))
def family(request, tiny_checkpoint, tmp_path_factory):
    """(our loaded model, the transformers model) for one architecture."""
    if request.param.endswith("-window8"):  # every layer slides
        hf_model = make_tiny_model(request.param.removesuffix("-window8"), sliding_window=8)
        folder = tmp_path_factory.mktemp(request.param)
        hf_model.save_pretrained(folder)
    else:
        folder, hf_model = tiny_checkpoint(request.param)
    return load_model(folder), hf_model


def family_prompts(vocab: int, count: int) -> list[list[int]]:
    """`count` prompts of 3 to 40 tokens; the odd ones open with one shared 21-token prefix (two
    blocks of 8 and some), so prefix caching hits."""
    rng = np.random.default_rng(5)
    shared = rng.integers(2, vocab, size=21).tolist()
    return [(shared if i % 2 else []) + rng.integers(2, vocab, size=int(n)).tolist()
            for i, n in enumerate(rng.integers(3, 20, size=count))]


def engine_greedy(family, backend: str, prompts, steps: int, **options) -> tuple[list[list[int]], LLMEngine]:
    """Each prompt's greedy tokens from an engine on `backend` with chunked prefill (steps of at most
    24 tokens) and prefix caching over blocks of 8, and `options`; the batch is run twice, so the
    second run reads every shared prefix from the cache."""
    loaded, _ = family
    engine = LLMEngine(loaded.model, loaded.config, loaded.tokenizer, EngineConfig(**dict(
        attention_backend=backend, block_size=8, num_blocks=128, max_num_batched_tokens=24,
        enable_chunked_prefill=True, enable_prefix_caching=True) | options))
    params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True)
    llm = LLM.from_engine(engine)
    runs = [[o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] for _ in range(2)]
    assert runs[0] == runs[1]
    return runs[0], engine


@pytest.mark.parametrize("backend", ["cpu", "xla"])
def test_greedy_through_the_engine_matches_transformers(family, backend):
    loaded, hf_model = family
    prompts = family_prompts(loaded.config.vocab_size, 6)
    got, engine = engine_greedy(family, backend, prompts, STEPS)
    assert engine.resolved.attention_backend == backend
    assert engine.stats().prefix_cache_hit_blocks >= 3 * 2  # the second run's shared prefixes, at least
    assert got == [hf_greedy(hf_model, p, STEPS) for p in prompts]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_greedy_under_preemption_matches_transformers(family, mode):
    """The KV bytes of 13 blocks of every layer for 6 sequences of up to 56 tokens: sequences give way
    and come back. (A model of several KV groups has blocks of one group's layers: as many more.)"""
    loaded, hf_model = family
    prompts = family_prompts(loaded.config.vocab_size, 6)
    num_blocks = 1 + 13 * kv_groups(loaded.config).num_groups
    got, engine = engine_greedy(family, "cpu", prompts, STEPS, num_blocks=num_blocks, preemption_mode=mode)
    assert engine.stats().num_preemptions > 0
    assert got == [hf_greedy(hf_model, p, STEPS) for p in prompts]


def test_pallas_interpreter_through_the_engine_matches_transformers(family):
    loaded, hf_model = family
    prompts = family_prompts(loaded.config.vocab_size, 2)
    got, _ = engine_greedy(family, "pallas_interpret", prompts, 6)
    assert got == [hf_greedy(hf_model, p, 6) for p in prompts]
