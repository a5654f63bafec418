"""A bfloat16 KV cache under float32 weights (EngineConfig.kv_cache_dtype) in the engine, on a tiny
random model: pages stored as bfloat16, greedy tokens as float32's but where float32's two best
tokens were nearly tied, every backend and layout, the pool all free afterwards."""

import jax.numpy as jnp
import numpy as np
import pytest

from models import load_model
from paged_jax import LLM, EngineConfig, LLMEngine, SamplingParams
from paged_jax.core import kv_blocks, step_programs
from engine_cases import FORK_OPTIONS, generate_forks

STEPS = 24
# Greedy with the two logprobs the comparison reads: where the tokens part, how far apart float32's
# choice and the other one were.
PARAMS = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True, logprobs=2)
# Rounding K/V to bfloat16 moved the tiny model's chosen logprobs by up to 0.025 on these prompts; a
# choice within twice that of the runner-up may flip (a near-tie), one further apart may not.
NEAR_TIE = 0.05
SMALL = dict(num_blocks=256, max_num_seqs=4, max_num_batched_tokens=64)  # prefill chunks beside decodes


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint):
    folder, _ = tiny_checkpoint("smollm2")
    return load_model(folder)


@pytest.fixture(scope="module")
def prompts(tiny):
    rng = np.random.default_rng(5)
    return [rng.integers(2, tiny.config.vocab_size, size=int(n)).tolist() for n in rng.integers(3, 90, size=10)]


def run(tiny, prompts, **options):
    engine = LLMEngine(tiny.model, tiny.config, tiny.tokenizer, EngineConfig(**SMALL, **options))
    outputs = [o.outputs[0] for o in LLM.from_engine(engine).generate(prompts, PARAMS, use_tqdm=False)]
    return engine, outputs


@pytest.fixture(scope="module")
def float32(tiny, prompts):
    return run(tiny, prompts, block_size=16)[1]


@pytest.mark.parametrize("backend,kv_layout,block_size", [
    ("cpu", "head_major", 64), ("cpu", "token_major", 16), ("cpu", "head_major", 8), ("xla", "token_major", 16)])
def test_greedy_tokens_agree_with_float32_but_at_near_ties(tiny, prompts, float32, backend, kv_layout, block_size):
    engine, outputs = run(tiny, prompts, kv_cache_dtype="bfloat16", attention_backend=backend, kv_layout=kv_layout,
                          block_size=block_size)
    assert engine.resolved.kv_cache_dtype == "bfloat16" and engine.runner.kv_cache.k[0].dtype == jnp.bfloat16
    assert engine.resolved.dtype == "float32" and engine.resolved.attention_backend == backend
    identical = 0
    for ours, reference in zip(outputs, float32, strict=True):
        part = next((i for i, (a, b) in enumerate(zip(ours.token_ids, reference.token_ids)) if a != b), None)
        if part is None:
            identical += 1
            continue
        chosen, theirs = reference.logprobs[part], reference.token_ids[part]
        gap = chosen[theirs] - chosen.get(ours.token_ids[part], -np.inf)
        assert gap < NEAR_TIE, f"token {part} parted from float32's {theirs} with a logprob gap of {gap:.3g}"
    assert identical >= len(prompts) - 2
    engine.blocks.reset_prefix_cache()
    assert engine.blocks.num_free == engine.blocks.num_blocks - 1


def test_no_step_converts_or_copies_a_bfloat16_page_pool(tiny, prompts):
    """XLA's CPU backend would run a scatter or gather over bfloat16 pages in float32, converting the
    whole pool there and back every step: the step writes K/V through the C++ kernel instead, in place
    (no other array of the pool's shape), and block copies go through 16-bit integers."""
    engine = LLMEngine(tiny.model, tiny.config, tiny.tokenizer, EngineConfig(**SMALL, kv_cache_dtype="bfloat16",
                                                                             block_size=16))
    engine.add_request(prompts[0], PARAMS)
    scheduled = engine.scheduler.schedule().scheduled
    args, keywords = engine.runner.step_args(scheduled)
    pool = ",".join(map(str, engine.runner.kv_cache.k[0].shape))
    programs = {"step": step_programs.step.lower(*args, **keywords),
                "copy_blocks": kv_blocks.copy_blocks.lower(engine.runner.kv_cache, np.zeros((2, 2), np.int32),
                                                              np.int32(1))}
    for name, lowered in programs.items():
        text = lowered.compile().as_text()
        assert f"bf16[{pool}]" in text and f"f32[{pool}]" not in text, name
    assert f"u16[{pool}]" not in programs["step"].compile().as_text()
    engine.abort_request("0")


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_forks_preempted_on_a_full_pool_give_the_same_tokens_over_bfloat16_pages(tiny, prompts, mode):
    """Copy-on-write block copies and swaps out and back move bfloat16 pages bit for bit
    (test_engine.py's forks: sampled and beam-searched, on a pool too small for them)."""
    def forks(**options):
        engine = LLMEngine(tiny.model, tiny.config, tiny.tokenizer,
                           EngineConfig(**FORK_OPTIONS | options, kv_cache_dtype="bfloat16", kv_layout="head_major"))
        return engine, generate_forks(engine, [p * 2 for p in prompts])

    _, (roomy, _) = forks(num_blocks=256)
    engine, (tokens, preemptions) = forks(preemption_mode=mode)
    assert tokens == roomy and all(preemptions)
    engine.blocks.reset_prefix_cache()
    assert engine.blocks.num_free == engine.blocks.num_blocks - 1
