"""Client-side helpers for the server tests: read an SSE stream strictly, and read /metrics."""

import json
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

# Every client call in the server tests waits this long (httpx's default is 5 s): a busy CI machine may
# make a request wait on a compile or on another process for far longer than a quiet one, and a test
# must fail on what the server does, not on how fast the machine runs. Where a test bounds time
# because the bound is what it tests, it says so beside its own figure.
TIMEOUT = 300.0


def parse_events(body: str) -> list[dict | str]:
    """The events of a complete SSE body, each `data: <JSON>` then a blank line; "[DONE]" must be last.
    Raises AssertionError on anything malformed."""
    assert body.endswith("\n\n"), "the stream does not end with a complete event"
    events = []
    for block in body[:-2].split("\n\n"):
        assert block.startswith("data: ") and "\n" not in block, f"malformed event {block!r}"
        data = block[len("data: "):]
        events.append(data if data == "[DONE]" else json.loads(data))
    assert events and events[-1] == "[DONE]" and "[DONE]" not in events[:-1], "no single final [DONE]"
    return events[:-1]


def stream_text(chunks: list[dict]) -> dict[int, str]:
    """Choice index -> the text of a completions or chat stream, checking that each choice finishes once,
    in its last chunk."""
    texts, finished = {}, set()
    for chunk in chunks:
        for choice in chunk["choices"]:
            i = choice["index"]
            assert i not in finished, f"choice {i} has a chunk after its finish_reason"
            piece = choice["text"] if "text" in choice else choice["delta"].get("content") or ""
            texts[i] = texts.get(i, "") + piece
            if choice["finish_reason"] is not None:
                finished.add(i)
    assert finished == set(texts), f"choices {set(texts) - finished} never finished"
    return texts


def metrics(base_url: str) -> dict[str, float]:
    """/metrics as {name or name{label="value",...}: value} (labels other than model_name)."""
    out = {}
    for family in text_string_to_metric_families(httpx.get(f"{base_url}/metrics", timeout=TIMEOUT).text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()) if k != "model_name")
            out[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return out


def wait_for_idle(base_url: str, timeout: float = 120.0) -> dict[str, float]:
    """Wait until /metrics shows nothing running or waiting and no KV block held by a request (blocks
    the prefix cache alone holds are free to reuse); returns those metrics."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(base_url)
        if (m["paged_jax:num_requests_running"] == m["paged_jax:num_requests_waiting"] == 0
                and m['paged_jax:num_kv_cache_blocks{state="used"}'] == 0):
            return m
        assert time.monotonic() < deadline, f"the server did not go idle: {m}"
        time.sleep(0.02)


def wait_until_ready(base: str, timeout: float = 600.0) -> None:
    """Poll /ready until the server has warmed up (as a load balancer would before sending traffic)."""
    deadline = time.monotonic() + timeout
    while httpx.get(f"{base}/ready", timeout=TIMEOUT).status_code != 200:
        assert time.monotonic() < deadline, "the server never became ready"
        time.sleep(0.1)
