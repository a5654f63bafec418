"""AsyncLLMEngine on a tiny model: the tokens LLM.generate gives, aborts and timeouts that free their
blocks within a step or two, the waiting-queue cap, a failing step that fails only the requests it
held while the loop serves on, and calls run on the loop's thread."""

import asyncio
import contextlib
import threading
import time

import pytest

from paged_jax import LLM, EngineConfig, LLMEngine, SamplingParams
from paged_jax.serving.async_engine import (AsyncLLMEngine, EngineDeadError, EngineStepError, QueueFullError,
                                            StatLogger)

from conftest import slow_steps

OPTIONS = dict(block_size=16, num_blocks=128, max_num_seqs=4, max_num_batched_tokens=256)
LONG = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
QUEUE_CAP = 3


class Recorder(StatLogger):
    def __init__(self):
        self.finished = []

    def record(self, scheduler, iteration):
        self.finished += iteration.finished


def make_engine(loaded) -> LLMEngine:
    return LLMEngine(loaded.model, loaded.config, loaded.tokenizer, EngineConfig(**OPTIONS))


@pytest.fixture(scope="module")
def recorder():
    return Recorder()


@pytest.fixture(scope="module")
def engine(tiny_chat_model, recorder):
    engine = AsyncLLMEngine(make_engine(tiny_chat_model), max_num_queued_reqs=QUEUE_CAP, stat_loggers=[recorder])
    yield engine
    engine.shutdown()


async def wait_until(predicate, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting"
        await asyncio.sleep(0.01)


def idle_and_free(engine: AsyncLLMEngine) -> bool:
    stats = engine.scheduler_stats
    return stats.num_running == stats.num_waiting == 0 and stats.num_used_blocks == 0


async def final(engine, prompt, params, **options):
    out = None
    async for out in engine.generate(prompt, params, **options):
        pass
    return out


def test_generate_matches_llm(engine, tiny_chat_model):
    prompts = [[5, 6, 7], list(range(100, 140)), "Hello there, how are you?", list(range(2000, 2017))]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

    async def run():
        return await asyncio.gather(*(final(engine, p, params) for p in prompts))

    outputs = asyncio.run(run())
    expected = LLM.from_engine(make_engine(tiny_chat_model)).generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [e.outputs[0].token_ids for e in expected]
    assert [o.outputs[0].text for o in outputs] == [e.outputs[0].text for e in expected]
    assert all(o.finished and o.outputs[0].finish_reason == "length" for o in outputs)


def test_leaving_early_aborts_within_a_step(engine, recorder):
    async def run():
        seen = 0
        async with contextlib.aclosing(engine.generate([9] * 20, LONG, "leaver")) as outputs:
            async for out in outputs:
                seen = len(out.outputs[0].token_ids)
                if seen >= 3:
                    break
        await wait_until(lambda: idle_and_free(engine))
        return seen

    seen = asyncio.run(run())
    [aborted] = [f for f in recorder.finished if f.finish_reason == "abort"]
    # The request stopped where the reader left it, give or take the steps in flight.
    assert seen <= aborted.num_generation_tokens <= seen + 3


def test_timeout_ends_the_request_and_frees_its_blocks(engine, recorder):
    async def run():
        out = await final(engine, [11] * 30, LONG, timeout=0.3)
        await wait_until(lambda: idle_and_free(engine))
        return out

    slow_steps(engine.engine, 0.005)  # LONG's 400 tokens then take 2 s at least, however fast the machine
    try:
        out = asyncio.run(run())
    finally:
        del engine.engine.runner.dispatch
    assert out.finished and out.outputs[0].finish_reason == "timeout"
    assert len(out.outputs[0].token_ids) < LONG.max_tokens
    assert [f.finish_reason for f in recorder.finished].count("timeout") == 1


def test_queue_cap_refuses_and_keeps_what_it_accepted(engine):
    async def run():
        # max_num_seqs run, QUEUE_CAP wait; one more is refused.
        accepted = OPTIONS["max_num_seqs"] + QUEUE_CAP
        streams = await asyncio.gather(*(engine.add_request([20 + i] * 8, LONG) for i in range(accepted)))
        await wait_until(lambda: engine.scheduler_stats.num_waiting == QUEUE_CAP)
        with pytest.raises(QueueFullError) as refused:
            await engine.add_request([1, 2, 3], LONG)
        assert refused.value.retry_after > 0
        # Everything accepted is still there, and runs.
        assert engine.scheduler_stats.num_running == OPTIONS["max_num_seqs"]
        firsts = await asyncio.gather(*(anext(s) for s in streams[: OPTIONS["max_num_seqs"]]))
        assert all(o.outputs[0].token_ids for o in firsts)
        for s in streams:
            s.close()
        await wait_until(lambda: idle_and_free(engine))

    asyncio.run(run())


def test_a_failing_step_fails_its_requests_and_the_loop_serves_on(engine, recorder):
    step = engine.engine.step

    def failing():
        del engine.engine.step  # fail once, then the real step again
        raise RuntimeError("boom")

    async def run():
        streams = await asyncio.gather(*(engine.add_request([30 + i] * 8, LONG) for i in range(2)))
        engine.engine.step = failing
        for s in streams:
            with pytest.raises(EngineStepError, match="boom"):
                async for _ in s:
                    pass
        await wait_until(lambda: idle_and_free(engine))
        return await final(engine, [40] * 8, SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))

    out = asyncio.run(run())
    assert engine.engine.step == step
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 5
    assert [f.finish_reason for f in recorder.finished].count("error") == 2


def test_a_bad_request_fails_alone(engine):
    async def run():
        good = asyncio.ensure_future(final(engine, [50] * 8, SamplingParams(temperature=0.0, max_tokens=5)))
        with pytest.raises(ValueError, match="empty"):
            await engine.add_request([], LONG)
        with pytest.raises(ValueError, match="already in use"):
            await asyncio.gather(engine.add_request([1], LONG, "twice"), engine.add_request([1], LONG, "twice"))
        engine.abort("twice")
        return await good

    assert asyncio.run(run()).finished


def test_priority_orders_the_waiting_requests(engine, tiny_chat_model):
    loaded = tiny_chat_model
    config = EngineConfig(**OPTIONS | dict(max_num_seqs=1), scheduling_policy="priority")
    prioritised = AsyncLLMEngine(LLMEngine(loaded.model, loaded.config, loaded.tokenizer, config))
    short = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    done = []

    async def run():
        first = asyncio.ensure_future(final(prioritised, [60] * 8, LONG, request_id="first"))
        await wait_until(lambda: prioritised.scheduler_stats.num_running == 1)

        async def one(name, priority):
            await final(prioritised, [61 + priority] * 8, short, request_id=name, priority=priority)
            done.append(name)

        # All three wait behind the running one, queued in the reverse of their priority; then it leaves.
        rest = [asyncio.ensure_future(one(f"p{p}", p)) for p in (2, 1, 0)]
        await wait_until(lambda: prioritised.scheduler_stats.num_waiting == 3)
        prioritised.abort("first")
        assert (await first).outputs[0].finish_reason == "abort"  # its reader hears of the abort
        await asyncio.gather(*rest)
        # The engine that serves first come, first served refuses a priority rather than ignore it.
        with pytest.raises(ValueError, match="priority"):
            await engine.add_request([1, 2], short, priority=1)

    try:
        asyncio.run(run())
    finally:
        prioritised.shutdown()
    assert done == ["p0", "p1", "p2"]


def test_call_runs_on_the_loop_thread_between_steps(engine, tiny_chat_model):
    def where(llm_engine):
        assert llm_engine is engine.engine
        return threading.current_thread().name, llm_engine.has_unfinished_requests()

    def fails(_):
        raise KeyError("from the loop")

    async def run():
        assert await engine.call(where) == ("paged-jax-engine", False)  # an idle loop wakes for it
        busy = asyncio.ensure_future(final(engine, [5] * 8, SamplingParams(temperature=0.0, max_tokens=40,
                                                                          ignore_eos=True)))
        await wait_until(lambda: engine.scheduler_stats.num_running == 1)
        assert await engine.call(where) == ("paged-jax-engine", True)
        with pytest.raises(KeyError, match="from the loop"):
            await engine.call(fails)
        await busy

    asyncio.run(run())
    stopped = AsyncLLMEngine(make_engine(tiny_chat_model))
    stopped.shutdown()
    with pytest.raises(EngineDeadError):
        asyncio.run(stopped.call(where))
