"""Sliding-window KV that costs only its window, through the engine: a tiny Gemma 3 of Gemma 3's pattern
(five sliding layers to a full one, so six KV groups over one page array), a window of 16 tokens over
blocks of 4 and prompts of 60 to 90 tokens. Greedy tokens equal transformers' with chunked prefill,
prefix caching of a 48-token shared prefix (three windows), and preemption by recompute and by swap;
at every decode a sliding group holds its window and a block at most; the pool ends all free."""

import numpy as np
import pytest

from conftest import hf_greedy, make_tiny_model
from models import load_model
from models.config import FULL, SLIDING
from models.kv_groups import kv_groups
from paged_jax import LLM, EngineConfig, LLMEngine, SamplingParams
from paged_jax.core.block_pool import NULL_BLOCK

WINDOW, BS, STEPS = 16, 4, 12


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    hf_model = make_tiny_model("gemma3", num_hidden_layers=6, head_dim=32, sliding_window=WINDOW,
                               layer_types=[FULL if (i + 1) % 6 == 0 else SLIDING for i in range(6)])
    folder = tmp_path_factory.mktemp("gemma3-window16")
    hf_model.save_pretrained(folder)
    return load_model(folder), hf_model


def prompts(vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(7)
    shared = rng.integers(2, vocab, size=48).tolist()
    return [shared + rng.integers(2, vocab, size=12 + 10 * i).tolist() for i in range(3)] + \
        [rng.integers(2, vocab, size=70).tolist()]


def run(gemma3, **options):
    """Each prompt's greedy tokens, run twice (the second reads the shared prefix from the cache), the
    engine and its stats at the end; every step's decodes are checked for what their sliding groups hold:
    the window and a block, and a block per 4 tokens more where a dispatch runs several decode steps."""
    loaded, _ = gemma3
    engine = LLMEngine(loaded.model, loaded.config, loaded.tokenizer, EngineConfig(**dict(
        attention_backend="cpu", block_size=BS, num_blocks=400, max_num_batched_tokens=32,
        enable_chunked_prefill=True, enable_prefix_caching=True) | options))
    held = []

    def observe(scheduled):
        for s in scheduled:
            if s.num_new_tokens == 1:  # the window, and the blocks its decode steps' tokens land in
                held.extend(sum(b != NULL_BLOCK for b in ids) - (-(-(WINDOW - 1 + s.num_steps) // BS) - WINDOW // BS)
                            for ids in s.seq.group_block_ids)
    engine.runner.step_observers.append(observe)
    llm = LLM.from_engine(engine)
    params = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True)
    texts = prompts(loaded.config.vocab_size)
    runs = [[o.outputs[0].token_ids for o in llm.generate(texts, params, use_tqdm=False)] for _ in range(2)]
    assert runs[0] == runs[1]
    assert held and max(held) <= WINDOW // BS + 1
    stats = engine.stats()
    engine.blocks.reset_prefix_cache()
    assert engine.blocks.num_free == engine.resolved.num_blocks - 1  # nothing leaked
    return runs[0], engine, stats


def test_gemma3_pattern_makes_six_groups_over_one_page_array(gemma3):
    loaded, _ = gemma3
    groups = kv_groups(loaded.config)
    assert groups.windows == (None,) + (WINDOW,) * 5 and groups.num_arrays == 1


def test_greedy_with_chunked_prefill_and_prefix_caching_matches_transformers(gemma3):
    got, engine, stats = run(gemma3)
    assert engine.resolved.kv_groups.num_groups == 6 and len(engine.runner.kv_cache.k) == 1
    assert stats.prefix_cache_hit_blocks >= 3 * 48 // BS  # the second run's shared prefixes
    assert got == [hf_greedy(gemma3[1], p, STEPS) for p in prompts(gemma3[0].config.vocab_size)]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_greedy_under_preemption_matches_transformers(gemma3, mode):
    """A pool that holds two of the four sequences at a time: they give way and come back."""
    got, _, stats = run(gemma3, num_blocks=100, preemption_mode=mode)
    assert stats.num_preemptions > 0
    assert got == [hf_greedy(gemma3[1], p, STEPS) for p in prompts(gemma3[0].config.vocab_size)]


def test_greedy_a_step_ahead_matches_transformers(gemma3):
    """Asynchronous scheduling: a sliding group gives back blocks while the step before still runs (it
    reads them before the next step, ordered after it, writes them again)."""
    got, engine, _ = run(gemma3, async_scheduling="on", num_blocks=100)
    assert engine.resolved.async_scheduling
    assert got == [hf_greedy(gemma3[1], p, STEPS) for p in prompts(gemma3[0].config.vocab_size)]


def test_forks_share_every_group_and_copy_on_write(gemma3):
    """n=2 samples fork once the prompt but its last token is computed, sharing its blocks in every
    group: a prompt of 58 tokens leaves the block of tokens 56 to 59 shared, and the samples' first two
    tokens (drawn apart) land in it, so each group's copy of it is made on the first write. Seeded, the
    samples are those of the one-group path (disable_hybrid_kv_cache_manager), which the families'
    tests hold to transformers."""
    loaded, _ = gemma3
    texts = [p[:58] for p in prompts(loaded.config.vocab_size)[:2]]
    params = SamplingParams(n=2, temperature=1.0, seed=11, max_tokens=STEPS, ignore_eos=True)
    runs = []
    for one_group in (False, True):
        engine = LLMEngine(loaded.model, loaded.config, loaded.tokenizer, EngineConfig(
            attention_backend="cpu", block_size=BS, num_blocks=400, max_num_batched_tokens=32,
            disable_hybrid_kv_cache_manager=one_group))
        assert engine.resolved.kv_groups.num_groups == (1 if one_group else 6)
        outputs = LLM.from_engine(engine).generate(texts, params, use_tqdm=False)
        runs.append([[o.token_ids for o in out.outputs] for out in outputs])
        engine.blocks.reset_prefix_cache()
        assert engine.blocks.num_free == engine.resolved.num_blocks - 1
    assert all(a[:2] != b[:2] for a, b in runs[0])  # the samples part before the shared block is full
    assert runs[0] == runs[1]


def test_greedy_in_multi_step_decode_matches_transformers(gemma3):
    """Four decode steps a dispatch (num_scheduler_steps): each group's slots found on the device from its
    own page table, the blocks of all four steps reserved in every group beforehand."""
    got, engine, _ = run(gemma3, num_scheduler_steps=4)
    assert got == [hf_greedy(gemma3[1], p, STEPS) for p in prompts(gemma3[0].config.vocab_size)]
