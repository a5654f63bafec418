"""A step's host work on a sequence does not grow with its output: with the model call left out
(a runner that returns tokens of real text at once), a step at the sequence's 4,000th output token
takes within 1.5x of a step at its 100th, for the output kinds a server and LLM.generate use. Decoding
the whole output every step, as the engine once did, made that ratio about 16."""

import dataclasses
import statistics
import time

import numpy as np
import pytest

from models.loader import load_tokenizer
from models.tiny import TINY_LLAMA, random_model
from paged_jax import EngineConfig, LLMEngine, SamplingParams
from paged_jax.core.sampling import SamplerOutput
from paged_jax.core.sampling_params import RequestOutputKind

SHORT, LONG = 100, 4000
REPEATS = 60
TEXT = "The quick brown fox jumps over the lazy dog, naïvely: 東京 🙂 and so on. " * 40


@pytest.fixture(scope="module")
def model_and_tokenizer():
    tokenizer = load_tokenizer("smollm2-135m")
    config = dataclasses.replace(TINY_LLAMA, vocab_size=len(tokenizer), max_position_embeddings=8192)
    return random_model(config), config, tokenizer


def engine_at(model_and_tokenizer, kind: RequestOutputKind, num_output_tokens: int) -> LLMEngine:
    """An engine whose runner samples the tokens of TEXT in turn, with one request that has generated
    num_output_tokens of them (stop strings, which never match, and logprobs are checked as it goes)."""
    model, config, tokenizer = model_and_tokenizer
    engine = LLMEngine(model, config, tokenizer, EngineConfig(block_size=16, num_blocks=300, max_num_seqs=1))
    text_ids = tokenizer.encode(TEXT)
    position = iter(range(10**9))

    def execute(scheduled, copies):
        rows = len(scheduled)
        tokens = np.array([text_ids[next(position) % len(text_ids)] for _ in range(rows)], np.int32)
        top_ids = np.tile(np.arange(20, dtype=np.int32), (rows, 1))
        return SamplerOutput(tokens, np.full(rows, -0.5, np.float32), np.full((rows, 20), -1.0, np.float32), top_ids)

    engine.runner.dispatch = execute
    params = SamplingParams(temperature=0.0, max_tokens=LONG + 2 * REPEATS, ignore_eos=True, logprobs=2,
                            stop=["never in this text", "zebra crossing"], output_kind=kind)
    engine.add_request([5, 6, 7], params)
    for _ in range(num_output_tokens):
        engine.step()
    return engine


@pytest.mark.parametrize("kind", [RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY])
def test_a_step_at_the_4000th_token_costs_what_one_at_the_100th_does(model_and_tokenizer, kind):
    short, long = engine_at(model_and_tokenizer, kind, SHORT), engine_at(model_and_tokenizer, kind, LONG)
    times = {short: [], long: []}
    # Interleaved, so that whatever else the machine does weighs on both alike; medians, for the same reason.
    for _ in range(REPEATS):
        for engine in (short, long):
            start = time.perf_counter()
            engine.step()
            times[engine].append(time.perf_counter() - start)
    ratio = statistics.median(times[long]) / statistics.median(times[short])
    assert ratio < 1.5, f"a step at token {LONG} took {ratio:.2f}x one at token {SHORT}"
