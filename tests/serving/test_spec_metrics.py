"""A server with speculative decoding: completions through the openai client are the tokens a server
without it gives, and /metrics counts its drafts under vLLM's names, beside the paged_jax: twins."""

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
import httpx

from conftest import running_server
from paged_jax import EngineConfig, LLMEngine
from paged_jax.serving.server import ServerConfig, build_app

MODEL = "tiny"
ENGINE = dict(block_size=16, num_blocks=256, max_num_seqs=4, max_num_batched_tokens=256)
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def completions(tiny_chat_model, prompts, **options) -> tuple[list[str], dict]:
    engine = LLMEngine(tiny_chat_model.model, tiny_chat_model.config, tiny_chat_model.tokenizer,
                       EngineConfig(**ENGINE, **options))
    with running_server(build_app(engine, ServerConfig(served_model_name=MODEL))) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
        texts = [client.completions.create(model=MODEL, prompt=p, max_tokens=24, temperature=0,
                                           extra_body=dict(ignore_eos=True)).choices[0].text for p in prompts]
        text = httpx.get(f"{url}/metrics").text
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, s.labels.get("position"))] = s.value
    return texts, samples


def test_same_completions_and_drafts_counted_under_vllm_names(tiny_chat_model):
    prompts = [[5, 6, 7, 8] * 6, [40, 41, 40, 41, 40, 42] * 3, [9, 10, 11, 12, 13] * 4 + [9, 10]]
    plain, _ = completions(tiny_chat_model, prompts)
    texts, samples = completions(tiny_chat_model, prompts, speculative_config=SPEC)
    assert texts == plain
    drafts = samples[("vllm:spec_decode_num_drafts_total", None)]
    draft_tokens = samples[("vllm:spec_decode_num_draft_tokens_total", None)]
    accepted = samples[("vllm:spec_decode_num_accepted_tokens_total", None)]
    assert drafts > 0 and drafts <= draft_tokens <= 3 * drafts and accepted <= draft_tokens
    per_position = [samples.get(("vllm:spec_decode_num_accepted_tokens_per_pos_total", str(i)), 0) for i in range(3)]
    assert sum(per_position) == accepted and per_position == sorted(per_position, reverse=True)
    assert samples[("paged_jax:spec_decode_num_drafts_total", None)] == drafts


def streamed(tiny_chat_model, prompt, **options) -> tuple[list[str], int, float]:
    """A streamed completion through the openai client: its chunks' texts, its completion tokens,
    and the draft tokens the server accepted."""
    engine = LLMEngine(tiny_chat_model.model, tiny_chat_model.config, tiny_chat_model.tokenizer,
                       EngineConfig(**ENGINE, **options))
    with running_server(build_app(engine, ServerConfig(served_model_name=MODEL))) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
        chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stream=True,
                                                stream_options={"include_usage": True},
                                                extra_body=dict(ignore_eos=True)))
        text = httpx.get(f"{url}/metrics").text
    accepted = sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
                   if s.name == "paged_jax:spec_decode_num_accepted_tokens_total")
    return [c.choices[0].text for c in chunks if c.choices], chunks[-1].usage.completion_tokens, accepted


def test_a_step_streams_its_accepted_tokens_as_one_event(tiny_chat_model):
    # As vLLM's deltas: one event per step and request with all the tokens it emitted, not one per
    # token, so a client's and the server's work per event is paid once per step.
    prompt = [5, 6, 7, 8] * 6
    plain, plain_tokens, _ = streamed(tiny_chat_model, prompt)
    texts, tokens, accepted = streamed(tiny_chat_model, prompt, speculative_config=SPEC)
    assert "".join(texts) == "".join(plain) and tokens == plain_tokens == 24
    assert accepted > 0
    # The prefill's token, then one event per step at most (a reader that falls behind gets steps folded).
    assert len(texts) <= tokens - accepted
