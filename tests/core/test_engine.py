"""The engine end to end on a tiny random model: greedy against transformers, the same tokens under
every scheduling regime, prefix sharing, preemption, sampling, stop conditions, and a pool that is all
free afterwards with nothing compiled after warm-up."""

import numpy as np
import pytest
import torch

from conftest import CHAT_PROMPTS, fail_in_xla, fail_on_host, hf_greedy
from engine_cases import GREEDY, STEPS, assert_all_free, finish_all, generate, make_engine, prompts, tiny  # noqa: F401
from paged_jax import LLM, EngineConfig, LLMEngine, SamplingParams

def test_greedy_batch_matches_transformers(tiny, prompts):
    engine = make_engine(tiny, block_size=16, num_blocks=256)
    batch = prompts[:8]
    assert generate(engine, batch) == [hf_greedy(tiny[1], p, STEPS) for p in batch]
    assert_all_free(engine)


@pytest.fixture(scope="module")
def one_at_a_time(tiny, prompts):
    engine = make_engine(tiny, block_size=16, num_blocks=256, max_num_seqs=1, enable_prefix_caching=False)
    return generate(engine, prompts)


REGIMES = {
    "all_at_once": dict(max_num_seqs=32, max_num_batched_tokens=4096, enable_chunked_prefill=False,
                        enable_prefix_caching=False),
    "chunked_prefill": dict(max_num_batched_tokens=48, enable_prefix_caching=False),
    "prefix_caching": dict(enable_prefix_caching=True),
    "preempt_recompute": dict(num_blocks=24, max_num_batched_tokens=64, preemption_mode="recompute"),
    "preempt_swap": dict(num_blocks=24, max_num_batched_tokens=64, preemption_mode="swap"),
    # Head-major pages through the write, the kernel, chunked prefill, prefix caching and swapping.
    "preempt_swap_head_major_pages": dict(num_blocks=24, max_num_batched_tokens=64, preemption_mode="swap",
                                          kv_layout="head_major"),
}


@pytest.mark.parametrize("regime", sorted(REGIMES))
def test_same_tokens_under_every_regime(tiny, prompts, one_at_a_time, regime):
    options = dict(block_size=8, num_blocks=512) | REGIMES[regime]
    engine = make_engine(tiny, **options)
    assert generate(engine, prompts) == one_at_a_time
    stats = engine.stats()
    if regime.startswith("preempt"):
        assert stats.num_preemptions > 0
    if regime == "prefix_caching":
        assert stats.prefix_cache_hit_blocks >= 15 * (37 // 8)
    assert_all_free(engine)
    # Warm: the same workload again meets only shapes it has compiled.
    compiles = engine.runner.num_compiles
    assert generate(engine, prompts) == one_at_a_time
    assert engine.runner.num_compiles == compiles
    assert_all_free(engine)


def test_prefix_cache_holds_a_shared_system_prompt_once(tiny):
    vocab = tiny[0].config.vocab_size
    rng = np.random.default_rng(1)
    system = rng.integers(2, vocab, size=200).tolist()
    prompts = [system + rng.integers(2, vocab, size=10).tolist() for _ in range(16)]
    block_size = 16
    engine = make_engine(tiny, block_size=block_size, num_blocks=512, max_num_batched_tokens=4096)
    for p in prompts:
        engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    engine.step()  # every prompt is admitted and prefilled in this one step
    seqs = engine.scheduler.running
    assert len(seqs) == 16
    full = 200 // block_size  # 12 full blocks of system prompt
    shared = {tuple(s.block_ids[:full]) for s in seqs}
    assert len(shared) == 1
    # 210 tokens need 14 blocks each: 12 shared, 2 of its own.
    assert engine.blocks.num_blocks - 1 - engine.blocks.num_free == full + 16 * 2
    while engine.has_unfinished_requests():
        engine.step()
    assert_all_free(engine)


def test_seeded_sampling_is_reproducible_across_batch_compositions(tiny, prompts):
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=12, ignore_eos=True)
    alone = generate(make_engine(tiny, block_size=8, num_blocks=256), [prompts[3]], params)[0]
    others = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    engine = make_engine(tiny, block_size=8, num_blocks=256)
    batch = prompts[:3] + [prompts[3]] + prompts[4:9]
    mixed = LLM.from_engine(engine).generate(batch, [others] * 3 + [params] + [others] * 5, use_tqdm=False)
    assert mixed[3].outputs[0].token_ids == alone
    assert len({tuple(o.outputs[0].token_ids) for o in mixed}) > 1  # the batch really sampled
    assert_all_free(engine)


def test_n_samples_fork_the_prompt_blocks(tiny, prompts):
    engine = make_engine(tiny, block_size=8, num_blocks=256)
    params = SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=10, ignore_eos=True)
    out = LLM.from_engine(engine).generate([prompts[5]], params, use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert len({tuple(c.token_ids) for c in out.outputs}) == 4
    assert all(len(c.token_ids) == 10 for c in out.outputs)
    assert_all_free(engine)


def test_max_tokens_min_tokens_and_stop_token_ids(tiny, prompts):
    engine = make_engine(tiny, block_size=8, num_blocks=256)
    greedy = generate(engine, [prompts[0]])[0]
    stop_at = greedy[5]
    first = greedy.index(stop_at)
    out = LLM.from_engine(engine).generate(
        [prompts[0]] * 3,
        [SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True),
         SamplingParams(temperature=0.0, max_tokens=STEPS, stop_token_ids=[stop_at], ignore_eos=True),
         SamplingParams(temperature=0.0, max_tokens=STEPS, min_tokens=first + 1, stop_token_ids=[stop_at],
                        ignore_eos=True)],
        use_tqdm=False)
    assert out[0].outputs[0].token_ids == greedy[:7] and out[0].outputs[0].finish_reason == "length"
    assert out[1].outputs[0].token_ids == greedy[: first + 1]
    assert (out[1].outputs[0].finish_reason, out[1].outputs[0].stop_reason) == ("stop", stop_at)
    # Banned until min_tokens, so the stop token cannot end it at `first`.
    assert len(out[2].outputs[0].token_ids) > first + 1
    assert_all_free(engine)


def test_prompt_longer_than_max_model_len_is_refused_and_nothing_else_is_disturbed(tiny, prompts):
    engine = make_engine(tiny, block_size=8, num_blocks=256, max_model_len=64)
    engine.add_request(prompts[0], GREEDY)
    with pytest.raises(ValueError, match=r"prompt of 80 tokens is too long: max_model_len is 64"):
        engine.add_request(list(range(2, 82)), GREEDY)
    with pytest.raises(ValueError, match="temperature"):
        engine.add_request(prompts[1], SamplingParams(temperature=-1.0))
    results = []
    while engine.has_unfinished_requests():
        results += [o for o in engine.step() if o.finished]
    assert [o.outputs[0].token_ids for o in results] == generate(make_engine(tiny, block_size=8, num_blocks=256), [prompts[0]])
    assert_all_free(engine)


def test_generate_checks_every_request_before_running_any(tiny, prompts):
    llm = LLM.from_engine(make_engine(tiny, block_size=8, num_blocks=256))
    with pytest.raises(ValueError, match="too long"):
        llm.generate([prompts[0], list(range(2, 300))], GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert_all_free(llm.engine)


def test_abort_frees_blocks_at_once(tiny, prompts):
    engine = make_engine(tiny, block_size=8, num_blocks=256)
    ids = [engine.add_request(p, GREEDY) for p in prompts[:4]]
    engine.step()
    engine.step()
    assert engine.blocks.num_free < engine.blocks.num_blocks - 1
    for request_id in ids:
        engine.abort_request(request_id)
    assert_all_free(engine)


def test_outputs_report_timing_and_logprobs(tiny, prompts):
    engine = make_engine(tiny, block_size=8, num_blocks=256)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3)
    plain = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    out, beside = LLM.from_engine(engine).generate([prompts[2], prompts[1]], [params, plain], use_tqdm=False)
    # As in vLLM, a request that asked for no logprobs has none, nor their sum, in any batch.
    assert beside.outputs[0].logprobs is None and beside.outputs[0].cumulative_logprob is None
    completion = out.outputs[0]
    assert len(completion.logprobs) == 6
    for token, entry in zip(completion.token_ids, completion.logprobs):
        assert token in entry and entry[token] == max(entry.values())  # greedy picks the top logprob
        assert len(entry) == 3
    assert np.isclose(completion.cumulative_logprob, sum(e[t] for t, e in zip(completion.token_ids, completion.logprobs)))
    assert out.metrics.time_to_first_token > 0 and out.metrics.time_per_output_token > 0


def test_engine_says_which_attention_backend_runs_and_how_it_schedules(tiny, caplog):
    with caplog.at_level("INFO", logger="paged_jax.core.resolve"):
        engine = make_engine(tiny, block_size=8, num_blocks=64)
    stats = engine.stats()
    assert (stats.attention_backend, stats.attention_backend_reason) == ("cpu", "the C++ kernel for float32 on the CPU")
    assert "attention backend cpu: the C++ kernel for float32 on the CPU" in caplog.messages
    assert f"scheduling sync: {engine.resolved.scheduling.reason}" in caplog.messages
    stats = make_engine(tiny, block_size=8, num_blocks=64, dtype="bfloat16").stats()
    assert (stats.attention_backend, stats.attention_backend_reason) == ("xla", "the CPU kernel takes float32, not bfloat16")


@torch.no_grad()
def test_beam_search_matches_transformers(tiny, prompts):
    engine = make_engine(tiny, block_size=8, num_blocks=256)
    width, steps = 4, 8
    params = SamplingParams(n=width, use_beam_search=True, temperature=0.0, max_tokens=steps, ignore_eos=True)
    out = LLM.from_engine(engine).generate([prompts[4]], params, use_tqdm=False)[0]
    # EOS can never end a beam here (ignore_eos / min_new_tokens), so both searches run every step.
    hf = tiny[1].generate(torch.tensor([prompts[4]]), num_beams=width, num_return_sequences=width, do_sample=False,
                          max_new_tokens=steps, min_new_tokens=steps, early_stopping=True, length_penalty=1.0,
                          output_scores=True, return_dict_in_generate=True)
    assert [c.token_ids for c in out.outputs] == [s[len(prompts[4]):].tolist() for s in hf.sequences]
    assert np.allclose([c.cumulative_logprob for c in out.outputs], hf.sequences_scores.numpy() * steps, atol=1e-4)
    assert_all_free(engine)


FAULTS = {
    "scheduling": (lambda engine: engine.scheduler, "schedule", fail_on_host),
    "host": (lambda engine: engine.runner, "dispatch", fail_on_host),
    "xla": (lambda engine: engine.runner, "dispatch", lambda runner, *args: fail_in_xla(runner.kv_cache)),
}


@pytest.mark.parametrize("where", sorted(FAULTS))
def test_a_failing_step_ends_its_requests_with_an_error_and_the_engine_goes_on(tiny, prompts, monkeypatch, caplog,
                                                                               where):
    reference = generate(make_engine(tiny, block_size=8, num_blocks=256), prompts[:4])
    engine = make_engine(tiny, block_size=8, num_blocks=256, max_num_seqs=2)
    generate(engine, [prompts[1]])  # caches the prefix that prompts[3] shares
    a, b, c = (engine.add_request(p, GREEDY) for p in (prompts[0], prompts[2], prompts[3]))  # c waits
    engine.step()
    engine.step()
    owner, name, fault = FAULTS[where]
    target = owner(engine)
    original = getattr(target, name)

    def fail_once(*args):
        monkeypatch.setattr(target, name, original)
        fault(engine.runner, *args)

    monkeypatch.setattr(target, name, fail_once)
    failed = engine.step()
    assert [o.request_id for o in failed] == [a, b]
    for output in failed:
        assert output.finished and "injected fault" in output.error
        assert [c.finish_reason for c in output.outputs] == ["error"] and len(output.outputs[0].token_ids) == 2
    assert "an engine step failed" in caplog.text
    # A fault inside XLA took the donated KV cache, and the prefix cache's blocks with it.
    assert (len(engine.blocks.cache) == 0) == (where == "xla")
    d = engine.add_request(prompts[1], GREEDY)
    assert {i: o.outputs[0].token_ids for i, o in finish_all(engine).items()} == {c: reference[3], d: reference[1]}
    assert_all_free(engine)


def test_a_fault_that_takes_the_kv_cache_sends_the_running_requests_outside_the_step_back_to_compute(
        tiny, prompts, monkeypatch):
    reference = generate(make_engine(tiny, block_size=8, num_blocks=256), [prompts[0]])[0]
    # Two tokens a step: step 1 computes the first token of each prompt; step 2 forks `forking` into
    # four samples ahead of `bystander`, and only two of them fit.
    engine = make_engine(tiny, block_size=8, num_blocks=256, max_num_batched_tokens=2)
    forking = engine.add_request(prompts[1][:2], SamplingParams(n=4, seed=0, max_tokens=4, ignore_eos=True))
    bystander = engine.add_request(prompts[0], GREEDY)
    engine.step()
    monkeypatch.setattr(engine.runner, "dispatch", lambda *args: fail_in_xla(engine.runner.kv_cache))
    failed = engine.step()
    monkeypatch.undo()
    assert [o.request_id for o in failed] == [forking]
    assert [s.request_id for s in engine.scheduler.waiting] == [bystander]  # its first token's KV is gone
    assert {i: o.outputs[0].token_ids for i, o in finish_all(engine).items()} == {bystander: reference}
    assert_all_free(engine)


@pytest.fixture(scope="module")
def smollm2_llm(smollm2):
    model, config, tokenizer, _ = smollm2
    return LLM.from_engine(LLMEngine(model, config, tokenizer, EngineConfig(block_size=16, num_blocks=256)))


def test_smollm2_greedy_batch_matches_transformers(smollm2, smollm2_llm):
    prompts = [smollm2_llm.chat_prompt([{"role": "user", "content": c}]) for c in CHAT_PROMPTS]
    got = generate(smollm2_llm.engine, prompts, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))
    assert got == [hf_greedy(smollm2[3], p, 32) for p in prompts]
    assert_all_free(smollm2_llm.engine)


def test_stop_strings_cut_exactly(smollm2_llm):
    conversation = [{"role": "user", "content": CHAT_PROMPTS[1]}]
    greedy = SamplingParams(temperature=0.0, max_tokens=40)
    full = smollm2_llm.chat(conversation, greedy, use_tqdm=False)[0].outputs[0]
    stop = full.text[len(full.text) // 2 :][:6]  # a string that first appears mid-answer
    assert stop and full.text.find(stop) > 0
    cut = smollm2_llm.chat(conversation, SamplingParams(temperature=0.0, max_tokens=40, stop=[stop]), use_tqdm=False)[0]
    completion = cut.outputs[0]
    assert completion.text == full.text[: full.text.find(stop)]
    assert (completion.finish_reason, completion.stop_reason) == ("stop", stop)
    assert completion.token_ids == full.token_ids[: len(completion.token_ids)]
    assert_all_free(smollm2_llm.engine)
