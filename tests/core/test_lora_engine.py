"""LoRA through the engine (LLM(enable_lora=True), generate(lora_request=...)): greedy tokens of a tiny
Llama under three PEFT adapters and none, mixed in the same steps, equal PEFT's, with chunked prefill,
prefix caching, more adapters than slots, and preemption; the prefix cache never gives one adapter's
K/V to another; adapters come and go without a compile."""

import numpy as np
import pytest

from conftest import hf_greedy, make_peft_adapter
from engine_cases import assert_all_free
from models import load_model
from paged_jax import LLM, EngineConfig, LLMEngine, LoRARequest, SamplingParams
from paged_jax.core.errors import RequestError

STEPS = 12
ADAPTERS = (
    dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
    dict(r=4, lora_alpha=8, use_rslora=True,
         target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    dict(r=16, lora_alpha=12, target_modules=["k_proj", "o_proj", "gate_proj", "down_proj"]),
)


@pytest.fixture(scope="module")
def setup(tiny_checkpoint, tmp_path_factory):
    """(our loaded model, transformers' base, [(LoRARequest, PEFT model)])."""
    folder, hf_model = tiny_checkpoint("llama3")
    adapters = []
    for i, spec in enumerate(ADAPTERS, start=1):
        path = tmp_path_factory.mktemp(f"adapter{i}")
        adapters.append((LoRARequest(f"adapter{i}", i, str(path)), make_peft_adapter(hf_model, path, 10 + i, **spec)))
    return load_model(folder), hf_model, adapters


def engine(setup, **options) -> LLMEngine:
    loaded, _, _ = setup
    return LLMEngine(loaded.model, loaded.config, loaded.tokenizer, EngineConfig(**dict(
        block_size=8, num_blocks=128, max_num_batched_tokens=24, enable_chunked_prefill=True,
        enable_prefix_caching=True, enable_lora=True, max_loras=2, max_lora_rank=16, max_cpu_loras=2) | options))


GREEDY = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True)


def prompts_and_adapters(setup, count: int):
    """count prompts (half opening with one shared 21-token prefix), each with None or an adapter in turn."""
    loaded, _, adapters = setup
    rng = np.random.default_rng(3)
    shared = rng.integers(2, loaded.config.vocab_size, size=21).tolist()
    prompts = [(shared if i % 2 else []) + rng.integers(2, loaded.config.vocab_size, size=int(n)).tolist()
               for i, n in enumerate(rng.integers(3, 20, size=count))]
    return prompts, [None if i % 4 == 0 else adapters[i % 4 - 1][0] for i in range(count)]


def want(setup, prompts, requests):
    _, hf_model, adapters = setup
    models = {request.lora_int_id: model for request, model in adapters}
    return [hf_greedy(hf_model if r is None else models[r.lora_int_id], p, STEPS) for p, r in zip(prompts, requests)]


@pytest.mark.parametrize("options", [{}, dict(num_blocks=12), dict(num_blocks=12, preemption_mode="swap"),
                                     dict(speculative_config=dict(method="ngram", num_speculative_tokens=3,
                                                                  prompt_lookup_min=1, prompt_lookup_max=2))],
                         ids=("roomy", "preempt-recompute", "preempt-swap", "speculative"))
def test_mixed_adapters_match_peft(setup, options):
    """Three adapters over two slots and the base model, run twice (the second run's shared prefixes come
    from the cache): every prompt's greedy tokens are PEFT's for its adapter."""
    llm = LLM.from_engine(engine(setup, **options))
    prompts, requests = prompts_and_adapters(setup, 8)
    expected = want(setup, prompts, requests)
    for _ in range(2):
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=requests)]
        assert got == expected
    if "num_blocks" in options:
        assert llm.engine.scheduler.num_preemptions > 0
    if "speculative_config" in options:  # drafts verified under each row's adapter
        assert llm.engine.speculator.stats.num_drafts > 0
    assert llm.engine.adapters.num_loads > 2  # three adapters took turns in two slots
    assert_all_free(llm.engine)


def test_prefix_cache_never_crosses_adapters(setup):
    """The same prompt under the base model, then each adapter, then the first adapter again: only the
    last run finds its blocks cached, and every run gives its own adapter's tokens."""
    llm = LLM.from_engine(engine(setup))
    prompt = prompts_and_adapters(setup, 2)[0][1]  # 21 shared tokens and more: two full blocks and some
    _, _, adapters = setup
    runs = [None, adapters[0][0], adapters[1][0], adapters[0][0]]
    hits = []
    for request in runs:
        (output,) = llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=request)
        assert output.outputs[0].token_ids == want(setup, [prompt], [request])[0]
        hits.append(output.metrics.num_prefix_hit_tokens)
    assert hits[:3] == [0, 0, 0] and hits[3] >= 16


@pytest.mark.parametrize("max_loras", (1, 2))
def test_adapters_come_and_go_without_a_compile(setup, max_loras):
    """Steps of up to 256 tokens, so that prefill steps run the delta over one slot (one adapter) or over
    every slot (several: adapters.ONE_SLOT_MIN_TOKENS); every program was made by the warm-up."""
    eng = engine(setup, max_loras=max_loras, max_cpu_loras=max_loras, max_num_batched_tokens=256)
    eng.runner.warm_up()
    compiled = eng.runner.num_compiles
    llm = LLM.from_engine(eng)
    prompts, requests = prompts_and_adapters(setup, 6)
    prompts[1] = prompts[1] * 4  # 140 tokens and more
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=requests)]
    assert got == want(setup, prompts, requests)
    assert eng.adapters.num_loads >= 3 and eng.runner.num_compiles == compiled


def test_bad_lora_requests_are_refused(setup, tmp_path):
    loaded, _, adapters = setup
    plain = LLMEngine(loaded.model, loaded.config, loaded.tokenizer, EngineConfig(block_size=8, num_blocks=32))
    with pytest.raises(RequestError, match="not enabled"):
        plain.add_request([1, 2, 3], GREEDY, lora_request=adapters[0][0])
    small = engine(setup, max_lora_rank=8)
    with pytest.raises(RequestError, match="rank 16"):
        small.add_request([1, 2, 3], GREEDY, lora_request=adapters[2][0])
    with pytest.raises(RequestError, match="adapter_config.json"):
        small.add_request([1, 2, 3], GREEDY, lora_request=LoRARequest("missing", 9, str(tmp_path)))
    assert not small.has_unfinished_requests()
