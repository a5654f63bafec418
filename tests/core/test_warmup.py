"""Warm-up makes every program a step can run: after it, a workload that goes everywhere the engine's
limits allow (prompts up to the context length, full batches, chunked prefill, prefix hits, preemption
both ways, every sampling option, n > 1, beams, logprobs) compiles nothing; and warming up changes no
token."""

import jax
import numpy as np
import pytest

from models import load_model
from paged_jax import LLM, EngineConfig, LLMEngine, SamplingParams
from paged_jax.core import compiles, parallel_compile, warmup

LIMITS = dict(block_size=8, num_blocks=40, max_num_seqs=8, max_num_batched_tokens=64)


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint):
    return load_model(tiny_checkpoint("smollm2")[0])


def make_engine(tiny, **options) -> LLMEngine:
    return LLMEngine(tiny.model, tiny.config, tiny.tokenizer, EngineConfig(**LIMITS | options))


def test_a_program_loaded_or_compiled_is_counted():
    before = compiles.count()
    jax.jit(lambda x: x * 3 + 1)(np.arange(7))  # a program no one made before
    assert compiles.count() == before + 1 and compiles.seconds() > 0


def test_programs_compiled_side_by_side_are_the_ones_the_warm_up_runs(tiny, monkeypatch):
    """parallel_compile.py compiles the step's programs before the warm-up calls them: the calls must find
    them made (a cache committed elsewhere, or a sampler input placed elsewhere, would make each twice).
    The same engine warmed up twice, jit's caches emptied before each (a program loaded from the
    persistent cache counts as one made): compiling ahead makes no more programs than not doing so."""
    made = []
    for ahead in (True, False):
        if not ahead:  # but the first program, whose output says where the samplers' input lies
            monkeypatch.setattr(parallel_compile, "compile_all", lambda lowered: [p.compile() for p in lowered[:1]])
        jax.clear_caches()
        made.append(warmup.warm_up(make_engine(tiny, num_scheduler_steps=4)).num_programs)
    assert made[0] == made[1]


def workload(vocab: int, max_model_len: int, seed: int = 0) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = np.random.default_rng(seed)
    shared = rng.integers(2, vocab, size=40).tolist()  # five blocks that later prompts find cached
    options = [
        dict(temperature=0.0),
        dict(temperature=0.8, top_k=5),
        dict(temperature=1.2, top_p=0.7, min_p=0.05, seed=7),
        dict(temperature=0.0, repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.2),
        dict(temperature=0.0, logprobs=20),
        dict(temperature=1.0, n=3, logprobs=2),
        dict(temperature=0.0, use_beam_search=True, n=2),
        dict(temperature=0.5, min_tokens=4, stop_token_ids=list(range(2, 80))),  # bans over several words
    ]
    prompts, params = [], []
    for i in range(40):
        if i % 10 == 9:
            length = max_model_len - 8  # up to the context limit
        else:
            length = int(rng.integers(1, 120))
        prompt = rng.integers(2, vocab, size=length).tolist()
        prompts.append(shared + prompt[40:] if i % 3 == 0 and length > 40 else prompt)
        params.append(SamplingParams(max_tokens=int(rng.integers(4, 8)), ignore_eos=True, **options[i % len(options)]))
    return prompts, params


@pytest.mark.parametrize("options", [dict(preemption_mode="recompute"), dict(preemption_mode="swap"),
                                     dict(attention_backend="xla", enable_prefix_caching=False)],
                         ids=["recompute", "swap", "xla_attention"])
def test_nothing_compiles_after_warm_up(tiny, options):
    engine = make_engine(tiny, **options)
    done = warmup.warm_up(engine)
    buckets = engine.resolved.buckets
    assert (done.num_step_shapes, done.num_sampler_shapes) == (len(buckets.shapes()), 4 * len(buckets.all_sample_rows()))
    before = compiles.count()
    prompts, params = workload(tiny.config.vocab_size, engine.resolved.max_model_len)
    outputs = LLM.from_engine(engine).generate(prompts, params, use_tqdm=False)
    assert compiles.count() == before, "a step compiled after warm-up"
    assert all(o.finished for o in outputs)
    stats = engine.stats()
    assert stats.num_preemptions > 0, "the pool must be short enough to preempt"
    if engine.config.enable_prefix_caching:
        assert stats.prefix_cache_hit_blocks > 0
    engine.blocks.reset_prefix_cache()
    assert engine.blocks.num_free == engine.blocks.num_blocks - 1


def test_warm_up_changes_no_token(tiny):
    prompts, _ = workload(tiny.config.vocab_size, 256, seed=1)
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    cold = LLM.from_engine(make_engine(tiny)).generate(prompts, greedy, use_tqdm=False)
    warm_engine = make_engine(tiny)
    warmup.warm_up(warm_engine)
    warm = LLM.from_engine(warm_engine).generate(prompts, greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in warm] == [o.outputs[0].token_ids for o in cold]
