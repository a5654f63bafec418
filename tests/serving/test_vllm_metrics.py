"""/metrics as a vLLM-reading router scrapes it (production-stack router, Gateway API Inference
Extension): every `vllm:` name it reads is there, labelled `model_name`, with live values while
requests run and wait, and equal to the `paged_jax:` metric it twins."""

import concurrent.futures
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import running_server, slow_steps
from paged_jax import EngineConfig, LLMEngine
from paged_jax.serving.server import ServerConfig, build_app

MODEL = "tiny"
TIMEOUT = 300.0  # generous: the test checks what the server says, never how fast it says it
# Two sequences at a time, so that four requests make two wait.
ENGINE = dict(block_size=16, num_blocks=256, max_num_seqs=2, max_num_batched_tokens=256)

GAUGES = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "gpu_cache_usage_perc")
COUNTERS = ("prefix_cache_queries_total", "prefix_cache_hits_total", "gpu_prefix_cache_queries_total",
            "gpu_prefix_cache_hits_total", "num_preemptions_total", "prompt_tokens_total", "generation_tokens_total")
HISTOGRAMS = ("time_to_first_token_seconds", "inter_token_latency_seconds", "time_per_output_token_seconds",
              "e2e_request_latency_seconds", "request_queue_time_seconds", "request_prompt_tokens",
              "request_generation_tokens", "request_params_max_tokens", "request_params_n", "iteration_tokens_total")


def scrape(base: str) -> dict[tuple[str, frozenset], float]:
    """Every sample of /metrics: {(name, its labels as a frozenset of (key, value)): value}."""
    text = httpx.get(f"{base}/metrics", timeout=TIMEOUT).text
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: dict, name: str, **labels: str) -> float:
    """The sample `name` with exactly these labels besides model_name (and the vllm: twins' engine)."""
    want = {"model_name": MODEL, **labels} | ({"engine": "0"} if name.startswith("vllm:") else {})
    return samples[(name, frozenset(want.items()))]


@pytest.fixture(scope="module")
def base(tiny_chat_model):
    engine = LLMEngine(tiny_chat_model.model, tiny_chat_model.config, tiny_chat_model.tokenizer, EngineConfig(**ENGINE))
    slow_steps(engine, 0.02)  # the two waiting requests then wait 40 steps at least, however fast the machine
    with running_server(build_app(engine, ServerConfig(served_model_name=MODEL))) as url:
        yield url


def complete(base: str, prompt: list[int], max_tokens: int) -> dict:
    r = httpx.post(f"{base}/v1/completions", timeout=TIMEOUT, json=dict(
        model=MODEL, prompt=prompt, max_tokens=max_tokens, ignore_eos=True, temperature=0))
    assert r.status_code == 200, r.text
    return r.json()


def test_every_vllm_name_a_router_reads_is_there_with_live_values(base):
    before = scrape(base)
    for name in GAUGES + COUNTERS:
        value(before, f"vllm:{name}")  # present, labelled, before any traffic
    assert value(before, "vllm:cache_config_info", block_size="16", num_gpu_blocks="255", enable_prefix_caching="True",
                 cache_dtype="float32") == 1

    # Four requests on two sequence slots: two run, two wait, and the router sees it.
    seen = {"running": 0.0, "waiting": 0.0, "kv": 0.0}
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(complete, base, [100 + i] * 40, 40) for i in range(4)]
        while not all(f.done() for f in futures):
            now = scrape(base)
            seen["running"] = max(seen["running"], value(now, "vllm:num_requests_running"))
            seen["waiting"] = max(seen["waiting"], value(now, "vllm:num_requests_waiting"))
            seen["kv"] = max(seen["kv"], value(now, "vllm:kv_cache_usage_perc"))
            assert value(now, "vllm:gpu_cache_usage_perc") == value(now, "vllm:kv_cache_usage_perc")
            time.sleep(0.02)
        [f.result() for f in futures]
    assert seen["running"] == 2 and seen["waiting"] >= 1 and seen["kv"] > 0

    # A repeated 64-token prompt: its first 3 blocks come from the prefix cache the second time.
    for _ in range(2):
        complete(base, list(range(200, 264)), 2)
    deadline = time.monotonic() + TIMEOUT
    while value(after := scrape(base), "vllm:num_requests_running") or value(after, "vllm:num_requests_waiting"):
        assert time.monotonic() < deadline, "the server never went idle"
        time.sleep(0.05)

    assert value(after, "vllm:prefix_cache_hits_total") >= 48
    assert value(after, "vllm:prefix_cache_queries_total") > value(after, "vllm:prefix_cache_hits_total")
    assert value(after, "vllm:request_success_total", finished_reason="length") == 6
    assert value(after, "vllm:prompt_tokens_total") == 4 * 40 + 2 * 64
    assert value(after, "vllm:generation_tokens_total") == 4 * 40 + 2 * 2
    assert value(after, "vllm:time_to_first_token_seconds_count") == 6
    assert value(after, "vllm:request_queue_time_seconds_count") == 6
    assert value(after, "vllm:e2e_request_latency_seconds_count") == 6
    assert value(after, "vllm:inter_token_latency_seconds_count") > 0
    assert value(after, "vllm:request_prompt_tokens_sum") == 4 * 40 + 2 * 64
    assert value(after, "vllm:request_generation_tokens_sum") == 4 * 40 + 2 * 2
    # Each twin says what its paged_jax: name says (buckets aside: the twins take vLLM's).
    for name in GAUGES[:3] + COUNTERS[:2] + COUNTERS[4:]:
        assert value(after, f"vllm:{name}") == value(after, f"paged_jax:{name}"), name
    assert value(after, "vllm:gpu_prefix_cache_hits_total") == value(after, "vllm:prefix_cache_hits_total")
    assert value(after, "vllm:gpu_prefix_cache_queries_total") == value(after, "vllm:prefix_cache_queries_total")
    for name in HISTOGRAMS:
        ours = name.replace("time_per_output_token", "inter_token_latency")  # vLLM's older name for the same
        assert value(after, f"vllm:{name}_count") == value(after, f"paged_jax:{ours}_count"), name
        assert value(after, f"vllm:{name}_bucket", le="+Inf") == value(after, f"vllm:{name}_count")
