"""Speculative decoding in the engine: greedy outputs are the same tokens with and without drafts,
whatever cuts a sequence short (stop strings, max_tokens, the context's end, abort, preemption),
with n > 1 and with sampled requests beside greedy ones; the pool ends all free, and nothing compiles
after warm-up."""

import numpy as np
import pytest
from engine_cases import (  # noqa: F401
    GREEDY,
    assert_all_free,
    finish_all,
    generate,
    make_engine,
    prompts,
    tiny,
)

from paged_jax import LLM, SamplingParams
from paged_jax.core.engine_parts import DRAFT_BUDGETS
from paged_jax.core.warmup import warm_up
from paged_jax.spec_decode.config import SpeculativeConfig

# Never off by batch size nor cut by a step's draft budget: these tests verify drafts of many sequences
# in one step.
UNBOUNDED = {"disable_by_batch_size": None, "max_draft_tokens_per_step": 1024}
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3} | UNBOUNDED
SUFFIX = {"method": "suffix", "num_speculative_tokens": 4} | UNBOUNDED


@pytest.fixture(scope="module")
def repeating(tiny):
    """Prompts that repeat themselves, so drafts are found, and a tiny random model's greedy output,
    which falls into loops, is often what they propose."""
    vocab = tiny[0].config.vocab_size
    rng = np.random.default_rng(3)
    out = []
    for n in rng.integers(3, 12, size=12):
        phrase = rng.integers(2, vocab, size=int(n)).tolist()
        out.append(phrase * 3 + phrase[: n // 2])
    return out


@pytest.mark.parametrize("spec", [NGRAM, SUFFIX], ids=["ngram", "suffix"])
def test_greedy_tokens_are_the_same_with_drafts(tiny, prompts, repeating, spec):
    batch = repeating + prompts[:8]
    plain = generate(make_engine(tiny, block_size=8, num_blocks=512), batch)
    engine = make_engine(tiny, block_size=8, num_blocks=512, speculative_config=spec)
    assert generate(engine, batch) == plain
    stats = engine.speculator.stats
    assert stats.num_accepted_tokens > 0 and stats.num_accepted_tokens < stats.num_draft_tokens
    assert sum(stats.accepted_per_position) == stats.num_accepted_tokens
    assert_all_free(engine)
    if engine.speculator.suffix is not None:  # emptied, its cache takes no output of the requests before
        engine.speculator.forget_outputs()
        generate(engine, batch[:1])
        generate(engine, batch[1:2])  # its first step caches the output of the one before
        assert engine.speculator.suffix.cached.tolist() == plain[0] + [-1]


def test_one_at_a_time_and_under_preemption(tiny, prompts, repeating):
    batch = repeating[:6] + prompts[:6]
    plain = generate(make_engine(tiny, block_size=8, num_blocks=512, max_num_seqs=1), batch)
    for options in (dict(max_num_seqs=1), dict(num_blocks=24, max_num_batched_tokens=64),
                    dict(num_blocks=24, max_num_batched_tokens=64, preemption_mode="swap"),
                    dict(max_num_batched_tokens=16, enable_chunked_prefill=True)):
        engine = make_engine(tiny, **(dict(block_size=8, num_blocks=512) | options), speculative_config=NGRAM)
        assert generate(engine, batch) == plain, options
        if options.get("num_blocks") == 24:
            assert engine.stats().num_preemptions > 0
        assert engine.speculator.stats.num_accepted_tokens > 0
        assert_all_free(engine)


def test_stops_and_length_limits_cut_accepted_drafts(tiny, repeating):
    llm_plain = LLM.from_engine(make_engine(tiny, block_size=8, num_blocks=512))
    engine = make_engine(tiny, block_size=8, num_blocks=512, speculative_config=NGRAM)
    llm_spec = LLM.from_engine(engine)
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (1, 2, 3, 5, 7, 11)]
    for p in params:
        a = [o.outputs[0] for o in llm_spec.generate(repeating, p, use_tqdm=False)]
        b = [o.outputs[0] for o in llm_plain.generate(repeating, p, use_tqdm=False)]
        assert [(x.token_ids, x.finish_reason) for x in a] == [(x.token_ids, x.finish_reason) for x in b]
    # The context's end (max_model_len 40) and stop strings taken from the plain run's own text.
    long = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    b = [o.outputs[0] for o in LLM.from_engine(make_engine(tiny, block_size=8, num_blocks=512, max_model_len=40))
         .generate(repeating, long, use_tqdm=False)]
    short = make_engine(tiny, block_size=8, num_blocks=512, max_model_len=40, speculative_config=NGRAM)
    a = [o.outputs[0] for o in LLM.from_engine(short).generate(repeating, long, use_tqdm=False)]
    assert short.speculator.stats.num_accepted_tokens > 0
    assert_all_free(short)
    assert [(x.token_ids, x.finish_reason) for x in a] == [(x.token_ids, x.finish_reason) for x in b]
    for prompt, done in zip(repeating, b):
        if len(done.text) < 8:
            continue
        stop = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[done.text[5:8]], logprobs=2)
        x = llm_spec.generate([prompt], stop, use_tqdm=False)[0].outputs[0]
        y = llm_plain.generate([prompt], stop, use_tqdm=False)[0].outputs[0]
        assert (x.text, x.token_ids, x.finish_reason) == (y.text, y.token_ids, y.finish_reason)
        assert [sorted(e) for e in x.logprobs] == [sorted(e) for e in y.logprobs]
        np.testing.assert_allclose([e[t].logprob for e, t in zip(x.logprobs, x.token_ids)],
                                   [e[t].logprob for e, t in zip(y.logprobs, y.token_ids)], atol=1e-4)
    assert engine.speculator.stats.num_accepted_tokens > 0
    assert_all_free(engine)


def test_n_samples_abort_and_sampled_rows_beside_greedy(tiny, repeating):
    seeded = SamplingParams(temperature=0.8, max_tokens=12, seed=7, n=3, ignore_eos=True)
    engine = make_engine(tiny, block_size=8, num_blocks=512, speculative_config=NGRAM)
    # n > 1 asks for sampling; so cold a temperature draws the argmax, whichever key draws it.
    greedy_n = SamplingParams(temperature=1e-5, max_tokens=16, n=2, ignore_eos=True)
    plain = LLM.from_engine(make_engine(tiny, block_size=8, num_blocks=512)).generate(repeating[:4], greedy_n,
                                                                                      use_tqdm=False)
    got = LLM.from_engine(engine).generate(repeating[:4], greedy_n, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in got] == [[c.token_ids for c in o.outputs] for o in plain]
    # Sampled requests run beside greedy ones and finish with their lengths.
    ids = [engine.add_request(p, seeded if i % 2 else GREEDY) for i, p in enumerate(repeating[:6])]
    victim = engine.add_request(repeating[6], GREEDY)
    engine.step()
    engine.step()
    engine.abort_request(victim)
    done = finish_all(engine)
    assert set(done) == set(ids)
    assert all(len(c.token_ids) == 12 for i in ids[1::2] for c in done[i].outputs)
    assert_all_free(engine)


def test_nothing_compiles_after_warm_up(tiny, repeating, prompts):
    engine = make_engine(tiny, block_size=8, num_blocks=512, max_num_seqs=8, max_num_batched_tokens=64,
                         speculative_config=NGRAM)
    warm_up(engine)
    compiles = engine.runner.num_compiles
    generate(engine, repeating + prompts[:4])
    mixed = [SamplingParams(temperature=0.7, top_k=5, max_tokens=10, seed=i, repetition_penalty=1.2) for i in range(4)]
    LLM.from_engine(engine).generate(repeating[:4], mixed, use_tqdm=False)
    assert engine.speculator.stats.num_drafts > 0
    assert engine.runner.num_compiles == compiles
    assert_all_free(engine)


def test_by_default_a_batch_of_the_measured_size_drafts_nothing(tiny, repeating):
    limit = SpeculativeConfig().disable_by_batch_size
    for running, drafts in ((limit, False), (limit - 1, True)):
        engine = make_engine(tiny, block_size=8, num_blocks=512, max_num_seqs=16,
                             speculative_config={k: v for k, v in NGRAM.items() if k != "disable_by_batch_size"})
        for prompt in repeating[:running]:
            engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
        for _ in range(8):  # every sequence still running: 8 steps of at most k + 1 tokens make under 64
            engine.step()
        assert len(engine.scheduler.running) == running
        assert (engine.speculator.stats.num_drafts > 0) == drafts
        finish_all(engine)
        assert_all_free(engine)


def test_a_step_verifies_at_most_its_draft_budget(tiny, repeating):
    """4 sequences under a budget of 6 draft 6 tokens at most in all, shared unevenly where their
    chances differ (draft_budget.py; evenly, each would draft one)."""
    plain = generate(make_engine(tiny, block_size=8, num_blocks=512), repeating[:4])
    engine = make_engine(tiny, block_size=8, num_blocks=512,
                         speculative_config=NGRAM | {"max_draft_tokens_per_step": 6})
    ids = [engine.add_request(prompt, GREEDY) for prompt in repeating[:4]]
    outputs, per_step = {}, []
    stats = engine.speculator.stats
    while engine.has_unfinished_requests():
        before, running = stats.num_draft_tokens, len(engine.scheduler.running)
        outputs |= {o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished}
        per_step.append((running, stats.num_draft_tokens - before))
    assert [outputs[i] for i in ids] == plain
    assert all(drafts <= 6 for _, drafts in per_step) and any(running == 4 and drafts > 4 for running, drafts in per_step), per_step
    assert stats.num_draft_tokens > 0
    assert_all_free(engine)
    # Unset, the budget is the engine's for its device.
    default = make_engine(tiny, block_size=8, num_blocks=512, speculative_config={"method": "ngram"})
    assert default.speculator.draft_budget == DRAFT_BUDGETS.get(default.resolved.platform)


def test_speculation_turns_itself_off(tiny, repeating):
    plain = generate(make_engine(tiny, block_size=8, num_blocks=512), repeating)
    # Above the batch size nothing drafts; the outputs are the same.
    engine = make_engine(tiny, block_size=8, num_blocks=512, speculative_config=NGRAM | {"disable_by_batch_size": 1})
    assert generate(engine, repeating) == plain
    assert engine.speculator.stats.num_drafts == 0
    # One at a time below the limit of 2: drafts again.
    engine = make_engine(tiny, block_size=8, num_blocks=512, max_num_seqs=1,
                         speculative_config=NGRAM | {"disable_by_batch_size": 2})
    assert generate(engine, repeating) == plain
    assert engine.speculator.stats.num_drafts > 0
    # A sequence whose drafts are not all accepted over a window of 4 pauses for 4 output tokens.
    eager = make_engine(tiny, block_size=8, num_blocks=512, speculative_config=NGRAM | {"min_acceptance_rate": 0})
    strict = make_engine(tiny, block_size=8, num_blocks=512,
                         speculative_config=NGRAM | {"min_acceptance_rate": 1.0, "acceptance_window": 4})
    assert generate(eager, repeating) == generate(strict, repeating) == plain
    e, s = eager.speculator.stats, strict.speculator.stats
    assert e.num_draft_tokens > e.num_accepted_tokens  # some rejected: the strict engine pauses someone
    assert s.num_draft_tokens < e.num_draft_tokens
    for engine in (eager, strict):
        assert_all_free(engine)


def test_refused_with_kv_in_several_groups(tiny_checkpoint):
    from models import load_model
    from paged_jax import EngineConfig, LLMEngine
    loaded = load_model(tiny_checkpoint("gemma2")[0])
    with pytest.raises(ValueError, match="disable_hybrid_kv_cache_manager"):
        LLMEngine(loaded.model, loaded.config, loaded.tokenizer, EngineConfig(speculative_config=NGRAM, num_blocks=64))
    engine = LLMEngine(loaded.model, loaded.config, loaded.tokenizer, EngineConfig(
        speculative_config=NGRAM, num_blocks=64, disable_hybrid_kv_cache_manager=True))
    assert engine.speculator is not None
