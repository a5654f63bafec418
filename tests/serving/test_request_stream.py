"""A request's stream hands its reader what output_kind asks, from the engine's DELTA outputs: deltas
folded together when the reader falls behind (nothing lost), the whole so far, or the final output
alone; and a deadline ends the request in the same terms."""

import asyncio

import pytest

from paged_jax.core.outputs import CompletionOutput, RequestMetrics, RequestOutput
from paged_jax.core.sampling_params import RequestOutputKind, SamplingParams
from paged_jax.serving.request_stream import RequestStream, engine_params


class Engine:
    """What a stream tells its AsyncLLMEngine: the aborts."""

    def __init__(self):
        self.aborted = []

    def _abort(self, request_id, reason):
        self.aborted.append((request_id, reason))


def delta(text: str, ids: list[int], finish: str | None = None, index: int = 0, *, last: bool = True) -> RequestOutput:
    """A one-sample delta; last: whether it finishes the request, once the sample finishes."""
    completion = CompletionOutput(index, text, ids, -1.0 * len(ids), None, finish)
    return RequestOutput("r", "prompt", [1, 2], [completion], last and finish is not None,
                         RequestMetrics(0.0, 0.1, None, len(ids), 0, 0))


async def read(kind: RequestOutputKind, deltas: list[RequestOutput], *, lag: bool) -> list[RequestOutput]:
    """The reader's outputs, posting the deltas one at a time (each read at once) or all before reading."""
    stream = RequestStream(Engine(), "r", SamplingParams(max_tokens=8, output_kind=kind), [1, 2],
                           asyncio.get_running_loop(), None)
    got = []
    for d in deltas:
        stream._put(d)
        if not lag and (d.finished or kind is not RequestOutputKind.FINAL_ONLY):
            got.append(await anext(stream))
    return got + [out async for out in stream]


DELTAS = [("Hel", [1]), ("lo", [2]), ("", [3]), (" you", [4, 5])]


def deltas() -> list[RequestOutput]:
    *running, (text, ids) = DELTAS
    return [delta(t, list(i)) for t, i in running] + [delta(text, list(ids), "length")]


@pytest.mark.parametrize("lag", [False, True])
def test_each_kind_from_deltas(lag):
    async def run(kind):
        return await read(kind, deltas(), lag=lag)

    got = asyncio.run(run(RequestOutputKind.DELTA))
    assert "".join(o.outputs[0].text for o in got) == "Hello you"
    assert sum((o.outputs[0].token_ids for o in got), []) == [1, 2, 3, 4, 5]
    assert len(got) == (1 if lag else 4) and got[-1].finished

    got = asyncio.run(run(RequestOutputKind.CUMULATIVE))
    assert [o.outputs[0].text for o in got] == (["Hello you"] if lag else ["Hel", "Hello", "Hello", "Hello you"])
    assert got[-1].outputs[0].token_ids == [1, 2, 3, 4, 5] and got[-1].outputs[0].finish_reason == "length"
    if not lag:
        assert got[0].outputs[0].token_ids == [1]  # what a reader held did not grow on

    [final] = asyncio.run(run(RequestOutputKind.FINAL_ONLY))
    assert final.finished and final.outputs[0].text == "Hello you"


def test_a_deadline_ends_the_running_samples_and_keeps_what_came():
    async def run():
        engine = Engine()
        params = SamplingParams(n=2, temperature=1.0, max_tokens=8, output_kind=RequestOutputKind.FINAL_ONLY)
        loop = asyncio.get_running_loop()
        stream = RequestStream(engine, "r", params, [1, 2], loop, loop.time() + 0.05)
        stream._put(delta("a", [7], index=0))
        stream._put(delta("b", [8], "stop", index=1, last=False))
        return [out async for out in stream], engine.aborted

    [final], aborted = asyncio.run(run())
    assert aborted == [("r", "timeout")] and final.finished
    assert [(c.index, c.text, c.token_ids, c.finish_reason) for c in final.outputs] == [
        (0, "a", [7], "timeout"), (1, "b", [8], "stop")]
    assert final.outputs[0].cumulative_logprob == -1.0  # the sample's own, not lost to the ending


def test_the_engine_is_asked_for_deltas():
    assert engine_params(SamplingParams()).output_kind is RequestOutputKind.DELTA
    beams = SamplingParams(n=2, use_beam_search=True, temperature=0.0)
    assert engine_params(beams).output_kind is RequestOutputKind.FINAL_ONLY  # beams have no deltas
