"""The engine tests' tiny model, prompts and helpers (test_engine.py, test_engine_forks.py); the
fixtures are imported by name into each test module."""

import numpy as np
import pytest

from models import load_model
from paged_jax import LLM, EngineConfig, LLMEngine, SamplingParams

STEPS = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint):
    """(our loaded model, the transformers model) for a SmolLM2-shaped tiny checkpoint."""
    folder, hf_model = tiny_checkpoint("smollm2")
    return load_model(folder), hf_model


def make_engine(tiny, **options) -> LLMEngine:
    loaded, _ = tiny
    return LLMEngine(loaded.model, loaded.config, loaded.tokenizer, EngineConfig(**options))


@pytest.fixture(scope="module")
def prompts(tiny):
    """32 prompts of mixed lengths; half open with one shared 37-token prefix, so caching can hit."""
    vocab = tiny[0].config.vocab_size
    rng = np.random.default_rng(0)
    shared = rng.integers(2, vocab, size=37).tolist()
    out = []
    for i, n in enumerate(rng.integers(2, 70, size=32)):
        own = rng.integers(2, vocab, size=int(n)).tolist()
        out.append(shared + own if i % 2 else own)
    return out


def generate(engine: LLMEngine, prompts, params=GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in LLM.from_engine(engine).generate(prompts, params, use_tqdm=False)]


def run(engine: LLMEngine, prompts, params) -> list:
    return LLM.from_engine(engine).generate(prompts, params, use_tqdm=False)


def completions(outputs) -> list[tuple]:
    """Each completion's tokens, text, finish and stop reasons, and its logprobs as (token ids, values)."""
    split = lambda logprobs: logprobs and [(list(entry), list(entry.values())) for entry in logprobs]
    return [(c.token_ids, c.text, c.finish_reason, c.stop_reason, split(c.logprobs)) for o in outputs
            for c in o.outputs]


def assert_same(outputs, expected) -> None:
    """Equal completions; logprobs to float32's rounding, as the two engines batch rows differently and a
    matmul over more rows may sum in another order."""
    got, want = completions(outputs), completions(expected)
    assert [c[:4] for c in got] == [c[:4] for c in want]
    for a, b in zip(got, want):
        assert (a[4] is None) == (b[4] is None)
        for (ids, values), (ids_b, values_b) in zip(a[4] or (), b[4] or ()):
            assert ids == ids_b and values == pytest.approx(values_b, rel=1e-4, abs=1e-5)


def rows_computed(engine: LLMEngine) -> list[int]:
    """Record the new tokens each dispatched step computes."""
    rows = []
    engine.runner.step_observers.append(lambda scheduled: rows.append(sum(s.num_new_tokens for s in scheduled)))
    return rows


def chat_engine(tiny_chat_model, **options) -> LLMEngine:
    """An engine over a tiny random model that speaks SmolLM2's vocabulary, with its tokenizer."""
    m = tiny_chat_model
    return LLMEngine(m.model, m.config, m.tokenizer, EngineConfig(**{"block_size": 8, "num_blocks": 256} | options))


def finish_all(engine: LLMEngine, max_steps: int = 2000) -> dict:
    """request id -> its finished output, stepping until nothing is left; a stuck engine fails
    the test rather than hanging it."""
    done = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return done
        done |= {o.request_id: o for o in engine.step() if o.finished}
    raise AssertionError(f"requests still unfinished after {max_steps} steps")


def assert_all_free(engine: LLMEngine) -> None:
    """Every block back in the pool once the prefix cache lets go of its own references."""
    assert not engine.has_unfinished_requests()
    engine.blocks.reset_prefix_cache()
    assert engine.blocks.num_free == engine.blocks.num_blocks - 1
    engine.blocks.commit()  # the pool of record follows at each step's commit (block_manager.py)
    engine.blocks.check()
    assert not np.asarray(engine.blocks.pool.refcounts).any()
    assert int(engine.blocks.pool.num_free) == engine.blocks.num_blocks - 1


# Issue 8's workload, forks on a pool of 12 blocks: three requests of n = 4 samples whose 40 tokens
# each need 4 blocks, and a beam search, newest, so its beams are the first to make way.
FORK_OPTIONS = dict(num_blocks=13, block_size=16, max_num_seqs=16, max_num_batched_tokens=256)
FORK_PARAMS = [SamplingParams(n=4, temperature=0.8, seed=i, max_tokens=40, ignore_eos=True) for i in range(3)] + [
    SamplingParams(n=3, use_beam_search=True, temperature=0.0, max_tokens=24, ignore_eos=True)]


def generate_forks(engine: LLMEngine, prompts) -> tuple[list, list]:
    """Each request's completions' token ids, and how often it was preempted."""
    outputs = LLM.from_engine(engine).generate([p[:20] for p in prompts[6:10]], FORK_PARAMS, use_tqdm=False)
    return [[c.token_ids for c in o.outputs] for o in outputs], [o.metrics.num_preemptions for o in outputs]
