"""scripts/bench_serving.py's goodput: successful requests within every objective given, per second."""

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parents[2] / "scripts"))
import bench_serving  # noqa: E402


def request(ttft: float, e2e: float, output_tokens: int) -> dict:
    return dict(ttft=ttft, e2e=e2e, itls=[], prompt_tokens=10, output_tokens=output_tokens)


def test_goodput_counts_requests_within_every_objective():
    results = [request(0.5, 2.5, 11),  # TPOT 0.2 s
               request(1.5, 2.0, 11),  # TTFT over
               request(0.5, 6.5, 11),  # TPOT 0.6 s: over
               request(0.2, 0.2, 1),  # one token: no TPOT to miss
               {"error": "429: ..."}]
    summary = bench_serving.summarize(results, duration=2.0, rate=4.0, goodput={"ttft": 1000, "tpot": 500})
    assert summary["good_requests"] == 2 and summary["goodput"] == 1.0
    assert summary["successful_requests"] == 4 and summary["failed_requests"] == 1
    assert "goodput" not in bench_serving.summarize(results, 2.0, 4.0, goodput={})


def test_goodput_flag_takes_key_ms_pairs():
    args = bench_serving.parse_args(["--goodput", "ttft:2000", "tpot:50"])
    assert args.goodput == {"ttft": 2000.0, "tpot": 50.0}
    for bad in (["--goodput", "ttft=2000"], ["--goodput", "itl:5"]):
        with pytest.raises(SystemExit):
            bench_serving.parse_args(bad)
