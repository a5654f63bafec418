"""paged_jax/research/perplexity.py against transformers' own logprobs on a tiny random model: windows
scored as fresh sequences, in prefill chunks that read earlier chunks' K/V back from the pages."""

import numpy as np
import pytest
import torch

from models import load_model
from paged_jax import EngineConfig, LLMEngine
from paged_jax.research.perplexity import perplexity, window_logprobs

CONTEXT, CHUNK = 128, 48  # windows of 128, 128 and 44 tokens; chunks that end inside blocks of 16


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint):
    folder, hf_model = tiny_checkpoint("smollm2")
    return load_model(folder), hf_model


@pytest.fixture(scope="module")
def tokens(tiny):
    return np.random.default_rng(2).integers(0, tiny[0].config.vocab_size, size=300).tolist()


@torch.no_grad()
def hf_logprobs(hf_model, window: list[int]) -> np.ndarray:
    logits = hf_model(torch.tensor([window])).logits[0, :-1].double()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(window[1:])[:, None])[:, 0].numpy()


def engine(tiny, **options) -> LLMEngine:
    loaded, _ = tiny
    return LLMEngine(loaded.model, loaded.config, loaded.tokenizer, EngineConfig(block_size=16, **options))


@pytest.mark.parametrize("backend", ["cpu", "xla"])
def test_float32_logprobs_and_perplexity_match_transformers(tiny, tokens, backend):
    ours = engine(tiny, attention_backend=backend)
    windows = [tokens[i : i + CONTEXT] for i in range(0, len(tokens), CONTEXT)]
    expected = np.concatenate([hf_logprobs(tiny[1], w) for w in windows])
    got = np.concatenate([window_logprobs(ours, w, chunk=CHUNK)[0] for w in windows])
    np.testing.assert_allclose(got, expected, atol=2e-4)
    figures = perplexity(ours, tokens, context=CONTEXT, chunk=CHUNK)
    assert figures["windows"] == 3 and figures["tokens_scored"] == len(tokens) - 3
    assert figures["perplexity"] == pytest.approx(np.exp(-expected.mean()), rel=1e-5)


def test_a_bfloat16_kv_cache_costs_little_perplexity(tiny, tokens):
    full = perplexity(engine(tiny), tokens, context=CONTEXT, chunk=CHUNK)["perplexity"]
    half = perplexity(engine(tiny, kv_cache_dtype="bfloat16"), tokens, context=CONTEXT, chunk=CHUNK)["perplexity"]
    assert half != full and half == pytest.approx(full, rel=0.02)
