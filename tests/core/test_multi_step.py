"""Multi-step decode (multi_step.py): several decode steps in one dispatch, the host reading each
sequence's tokens a dispatch at a time.

Every output must be what one step a dispatch gives, token for token and text for text, where a
dispatch ends a sequence part-way: max_tokens inside or at the end of a dispatch, a stop token id or
EOS sampled mid-dispatch, a stop string its text completes, an abort or a preemption while a dispatch
is in flight; with and without asynchronous scheduling; and nothing compiles after warm-up.
"""

import dataclasses
import types

import pytest

from engine_cases import (GREEDY, assert_all_free, assert_same, chat_engine, completions, finish_all,  # noqa: F401
                          make_engine, prompts, run, tiny)
from paged_jax import EngineConfig, LLMEngine, SamplingParams
from paged_jax.core import compiles, warmup
from paged_jax.core.config import AUTO_DECODE_STEPS
from paged_jax.core.resolve import resolve

STEPS = 4


def dispatches(engine: LLMEngine) -> list[int]:
    """Record the most steps each multi-step dispatch lets a row run."""
    seen, dispatch = [], engine.runner.dispatch

    def recording(scheduled, copies, num_steps=None):
        if num_steps is not None:
            seen.append(max(num_steps))
        return dispatch(scheduled, copies, num_steps)

    engine.runner.dispatch = recording
    return seen


def plain(**fields) -> SamplingParams:
    return dataclasses.replace(GREEDY, **fields)


# Rows that may run several steps: max_tokens before, at and past a dispatch's end; seeded draws with
# top-p and logprobs; n = 2.
MANY = [plain(max_tokens=1), plain(max_tokens=3), plain(max_tokens=STEPS), plain(max_tokens=STEPS + 1),
        plain(max_tokens=2 * STEPS + 3, logprobs=3),
        SamplingParams(temperature=0.9, top_p=0.8, seed=7, max_tokens=19, ignore_eos=True, logprobs=2),
        SamplingParams(n=2, temperature=1.0, seed=2, max_tokens=13, ignore_eos=True), plain(max_tokens=22)]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("options", [
    dict(),
    dict(max_num_batched_tokens=32),  # prompts chunked beside decodes, which then run one step
    dict(num_blocks=24, preemption_mode="recompute"),
    dict(num_blocks=24, preemption_mode="swap"),
], ids=["roomy", "chunked", "recompute", "swap"])
def test_outputs_equal_one_step_a_dispatch(tiny, prompts, options, async_scheduling):
    params = [MANY[i % len(MANY)] for i in range(12)]
    options = dict(block_size=8, num_blocks=512, max_num_seqs=6) | options
    expected = run(make_engine(tiny, **options), prompts[:12], params)
    engine = make_engine(tiny, num_scheduler_steps=STEPS, async_scheduling=async_scheduling, **options)
    seen = dispatches(engine)
    assert_same(run(engine, prompts[:12], params), expected)
    assert seen and max(seen) == STEPS
    if options["num_blocks"] < 100:
        assert engine.scheduler.num_preemptions > 0
    assert_all_free(engine)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_stop_token_or_eos_mid_dispatch_ends_the_sequence_there(tiny, prompts, async_scheduling):
    loaded, _ = tiny
    reference = [c[0] for c in completions(run(make_engine(tiny, block_size=8, num_blocks=256), prompts[:3], GREEDY))]
    # Ends that fall inside a dispatch: the 6th token as a stop id of one request, the 3rd as the
    # model's only EOS for the others (EOS banned until min_tokens for one of them).
    params = [plain(stop_token_ids=[reference[0][5]]), plain(ignore_eos=False),
              plain(ignore_eos=False, min_tokens=4)]
    config = dataclasses.replace(loaded.config, eos_token_ids=(reference[1][2],))
    engines = [LLMEngine(loaded.model, config, loaded.tokenizer,
                         make_engine(tiny, block_size=8, num_blocks=256, **options).config)
               for options in (dict(), dict(num_scheduler_steps=STEPS, async_scheduling=async_scheduling))]
    outs = [run(engine, prompts[:3], params) for engine in engines]
    assert_same(outs[1], outs[0])
    ends = [(len(c[0]), c[2], c[3]) for c in completions(outs[1])]
    assert ends[0] == (6, "stop", reference[0][5]) and ends[1] == (3, "stop", None)
    assert ends[2][1] == "stop" and ends[2][0] >= 4
    assert_all_free(engines[1])


def test_a_stop_string_completed_mid_dispatch(tiny_chat_model):
    one = chat_engine(tiny_chat_model)
    prompt = [one.tokenizer.encode("Write a long story about a lighthouse keeper.")]
    tokens = run(one, prompt, GREEDY)[0].outputs[0].token_ids
    # A stop string that only the sixth token completes, inside the dispatch of tokens 5 to 8.
    texts = [one.tokenizer.decode(tokens[:i], skip_special_tokens=True) for i in (5, 6)]
    stop = texts[0][-1:] + texts[1][len(texts[0]):][:1]
    assert len(stop) == 2 and stop not in texts[0]
    params = plain(stop=[stop])
    many = chat_engine(tiny_chat_model, num_scheduler_steps=STEPS)
    out = run(many, prompt, params)
    assert_same(out, run(one, prompt, params))
    (token_ids, text, finish_reason, stop_reason, _), = completions(out)
    assert finish_reason == "stop" and stop_reason == stop and stop not in text and len(token_ids) <= 6
    assert_all_free(many)


def test_an_abort_while_a_dispatch_is_in_flight(tiny, prompts):
    reference = [c[0] for c in completions(run(make_engine(tiny, block_size=8, num_blocks=256), prompts[:2], GREEDY))]
    engine = make_engine(tiny, block_size=8, num_blocks=256, async_scheduling=True, num_scheduler_steps=STEPS)
    seen = dispatches(engine)
    a, b = (engine.add_request(p, GREEDY) for p in prompts[:2])
    streamed = {a: [], b: []}
    while not seen or engine._in_flight is None:
        for o in engine.step():
            streamed[o.request_id] = o.outputs[0].token_ids
    engine.abort_request(a)
    done = finish_all(engine)
    assert a not in done and done[b].outputs[0].token_ids == reference[1]
    assert streamed[a] == reference[0][: len(streamed[a])]
    assert_all_free(engine)


def test_nothing_compiles_after_warm_up(tiny, prompts):
    engine = make_engine(tiny, block_size=8, num_blocks=256, max_num_seqs=8, num_scheduler_steps=STEPS,
                         async_scheduling=True)
    warmup.warm_up(engine)
    before, programs = compiles.count(), engine.runner.num_compiles
    seen = dispatches(engine)
    run(engine, prompts[:10], [MANY[i % len(MANY)] for i in range(10)])
    assert seen and compiles.count() == before and engine.runner.num_compiles == programs


def test_auto_runs_several_steps_on_an_accelerator_and_one_on_the_cpu(tiny):
    loaded, _ = tiny
    device = lambda platform: types.SimpleNamespace(platform=platform, memory_stats=lambda: None)
    steps = lambda platform, asked=None: resolve(EngineConfig(num_blocks=64, num_scheduler_steps=asked),
                                                 loaded.config, device(platform), "float32").num_scheduler_steps
    assert steps("gpu") == AUTO_DECODE_STEPS > 1 and steps("cpu") == 1
    assert steps("cpu", 4) == 4 and steps("gpu", 1) == 1
    with pytest.raises(ValueError, match="num_scheduler_steps"):
        EngineConfig(num_scheduler_steps=0)
