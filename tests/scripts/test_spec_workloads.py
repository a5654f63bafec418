"""scripts/spec_workloads.py: workload (a)'s requests ask for text their prompts hold, each request its
own, enough of them for bench_spec.py's served cells (fresh requests for every cell and round); quote's
requests on one document share it as their prompts' prefix and ask for its passages in turn."""

import os
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parents[2] / "scripts"))
import spec_workloads  # noqa: E402
from models.loader import load_tokenizer  # noqa: E402


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


@pytest.mark.parametrize("kind", ["edit", "rewrite", "quote"])
def test_repeating_workloads_hold_what_they_ask_for(tokenizer, kind):
    requests = spec_workloads.make(kind, tokenizer, 48, 64)  # 3 rounds of 16
    assert len(requests) == 48
    prompts = [tokenizer.decode(p) for p, _ in requests]
    assert len(set(prompts)) == 48  # no request repeats another
    for text, (_, max_tokens) in zip(prompts, requests):
        assert 0 < max_tokens <= 64
        body = text.split("\n\n", 1)[1] if kind != "quote" else text
        if kind == "edit":
            assert "```python\ndef " in text
        elif kind == "quote":  # the paragraph to quote is in the context
            opening = text.rsplit('begins "', 1)[1].split('"')[0]
            assert text.count(opening) >= 2
        assert len(tokenizer.encode(body)) > 60


def test_quote_is_questions_on_shared_documents(tokenizer):
    n = spec_workloads.QUOTE_PASSAGES
    requests = spec_workloads.make("quote", tokenizer, 2 * n, spec_workloads.MAX_TOKENS["quote"])
    for document in (requests[:n], requests[n:]):
        prompts = [p for p, _ in document]
        shared = len(os.path.commonprefix(prompts))
        assert shared > 0.8 * max(map(len, prompts))  # the worked exchange and the document
        openings = {tokenizer.decode(p).rsplit('begins "', 1)[1].split('"')[0] for p in prompts}
        assert len(openings) == n  # each asks for another passage
    assert os.path.commonprefix([requests[0][0], requests[n][0]]) != requests[0][0][: len(os.path.commonprefix(
        [p for p, _ in requests[:n]]))]  # the next document is another
    # Answers are whole passages: their caps are well past 64 tokens, under the workload's cap.
    caps = [m for _, m in requests]
    assert max(caps) <= spec_workloads.MAX_TOKENS["quote"] and sum(caps) / len(caps) > 100


def test_w1_takes_the_workload_requests_capped(tokenizer):
    requests = spec_workloads.make("w1", tokenizer, 5, 8)
    assert len(requests) == 5 and all(m <= 8 and len(p) > 0 for p, m in requests)
