"""Asynchronous scheduling (engine.py): the engine dispatches step N+1 before it reads step N's samples.

Every output must be what the synchronous engine gives, token for token and text for text, on the
paths where a token arrives one step late: a stop at exactly max_tokens, a stop string that a step's
token completes, an abort and a preemption while a step is in flight, penalties reading a pending
token, and constrained rows (which read the tokens first).
"""

import dataclasses
import json

import jsonschema
import pytest

from engine_cases import (GREEDY, assert_all_free, assert_same, chat_engine, completions, finish_all,  # noqa: F401
                          make_engine, prompts, rows_computed, run, tiny)
from paged_jax import EngineConfig, LLMEngine, SamplingParams, StructuredOutputsParams
from paged_jax.core.resolve import resolve


def running_ahead(engine: LLMEngine) -> list[bool]:
    """Record, at each step, whether a step was left in flight."""
    seen, step = [], engine.step

    def recording():
        outputs = step()
        seen.append(engine._in_flight is not None)
        return outputs

    engine.step = recording
    return seen


# Every sampling feature whose inputs count or read the tokens so far.
MIXED = [
    GREEDY,
    SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=20, ignore_eos=True, logprobs=2),
    SamplingParams(temperature=1.0, seed=5, max_tokens=18, repetition_penalty=1.4, presence_penalty=0.6,
                   frequency_penalty=0.4, ignore_eos=True),
    SamplingParams(n=3, temperature=1.0, seed=9, max_tokens=12, ignore_eos=True, min_tokens=4),
    SamplingParams(temperature=0.0, max_tokens=16, min_tokens=6, repetition_penalty=1.2),
]


@pytest.mark.parametrize("options", [
    dict(),
    dict(max_num_batched_tokens=32),  # chunked prefill beside decodes
    dict(num_blocks=40, preemption_mode="recompute"),
    dict(num_blocks=40, preemption_mode="swap"),
], ids=["roomy", "chunked", "recompute", "swap"])
def test_outputs_equal_the_synchronous_engines(tiny, prompts, options):
    params = [MIXED[i % len(MIXED)] for i in range(12)]
    options = dict(block_size=8, num_blocks=512, max_num_seqs=8) | options
    sync = make_engine(tiny, async_scheduling=False, **options)
    expected = run(sync, prompts[:12], params)
    engine = make_engine(tiny, async_scheduling=True, **options)
    ahead = running_ahead(engine)
    assert_same(run(engine, prompts[:12], params), expected)
    assert sum(ahead) > len(ahead) // 2
    if options["num_blocks"] < 100:
        assert engine.scheduler.num_preemptions > 0
    assert_all_free(engine)


def test_a_request_ending_at_max_tokens_computes_no_row_past_it(tiny, prompts):
    params = SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True)
    sync, ahead = (make_engine(tiny, block_size=8, num_blocks=256, async_scheduling=a) for a in (False, True))
    counted = [rows_computed(e) for e in (sync, ahead)]
    assert_same(run(ahead, prompts[:1], params), run(sync, prompts[:1], params))
    # The prompt, then a row for each token after the first: the seventh token is known to be the last.
    assert counted[1] == counted[0] == [len(prompts[0])] + [1] * 6


def test_a_stop_string_completed_by_a_token_read_one_step_late(tiny_chat_model):
    sync = chat_engine(tiny_chat_model, async_scheduling=False)
    prompt = [sync.tokenizer.encode("Write a long story about a lighthouse keeper.")]
    tokens = run(sync, prompt, GREEDY)[0].outputs[0].token_ids
    # A stop string that only the sixth token completes: the fifth's text ends with its first character.
    texts = [sync.tokenizer.decode(tokens[:i], skip_special_tokens=True) for i in (5, 6)]
    stop = texts[0][-1:] + texts[1][len(texts[0]):][:1]
    assert len(stop) == 2 and stop not in texts[0]
    params = dataclasses.replace(GREEDY, stop=[stop])
    ahead = chat_engine(tiny_chat_model, async_scheduling=True)
    counted = rows_computed(ahead)
    out = run(ahead, prompt, params)
    assert_same(out, run(sync, prompt, params))
    (token_ids, text, finish_reason, stop_reason, _), = completions(out)
    assert finish_reason == "stop" and stop_reason == stop and stop not in text and len(token_ids) <= 6
    # One row was computed past the stop, for nothing, and dropped.
    assert sum(counted) == len(prompt[0]) + len(token_ids)
    assert_all_free(ahead)


def test_an_abort_while_a_step_is_in_flight(tiny, prompts):
    reference = [c[0] for c in completions(run(make_engine(tiny, block_size=8, num_blocks=256), prompts[:2], GREEDY))]
    engine = make_engine(tiny, block_size=8, num_blocks=256, async_scheduling=True)
    a, b = (engine.add_request(p, GREEDY) for p in prompts[:2])
    seen = {a: [], b: []}
    for _ in range(4):
        for o in engine.step():
            seen[o.request_id] = o.outputs[0].token_ids
    assert engine._in_flight is not None
    engine.abort_request(a)
    done = finish_all(engine)
    assert a not in done and done[b].outputs[0].token_ids == reference[1]
    assert seen[a] == reference[0][: len(seen[a])]
    assert_all_free(engine)


def test_preemption_while_a_step_is_in_flight_in_both_modes(tiny, prompts):
    """A pool of 12 blocks of 8 for requests that grow to 12 and more: sequences are preempted while
    their next token is on the device, and come back to the same tokens."""
    for mode in ("recompute", "swap"):
        engine = make_engine(tiny, block_size=8, num_blocks=13, max_num_seqs=4, preemption_mode=mode,
                             async_scheduling=True)
        assert_same(run(engine, [p[:40] for p in prompts[:6]], GREEDY),
                    run(make_engine(tiny, block_size=8, num_blocks=512), [p[:40] for p in prompts[:6]], GREEDY))
        assert engine.scheduler.num_preemptions > 0
        assert_all_free(engine)


def test_constrained_rows_read_the_tokens_first(tiny_chat_model):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "maximum": 99}}, "required": ["n"],
              "additionalProperties": False}
    tokenizer = tiny_chat_model.tokenizer
    many = [tokenizer.encode(f"Give number {i} as JSON.") for i in range(3)]
    free = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    constrained = SamplingParams(temperature=0, max_tokens=48, structured_outputs=StructuredOutputsParams(json=schema))
    params = [free, free, constrained]
    outs = [run(chat_engine(tiny_chat_model, async_scheduling=a), many, params) for a in (False, True)]
    assert_same(outs[1], outs[0])
    jsonschema.validate(json.loads(outs[1][2].outputs[0].text), schema)


def test_auto_runs_ahead_on_an_accelerator_and_not_on_the_cpu(tiny):
    loaded, _ = tiny

    class Device:
        def __init__(self, platform):
            self.platform = platform

        def memory_stats(self):
            return None

    choose = lambda platform, asked="auto": resolve(EngineConfig(num_blocks=64, async_scheduling=asked),
                                                    loaded.config, Device(platform), "float32").scheduling
    assert choose("gpu").backend == "async" and choose("cpu").backend == "sync"
    assert choose("cpu", True) == ("async", "asked for", False)
    assert choose("gpu", "off").backend == "sync"
    with pytest.raises(ValueError, match="async_scheduling"):
        EngineConfig(async_scheduling="sometimes")
