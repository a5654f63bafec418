"""The research scripts in their smallest configurations: they run, and their figures are consistent
(fractions in [0, 1], contiguous reservations never wasting less than paged blocks, percentiles ordered)."""

import json
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parents[2] / "scripts"))

import compare_block_sizes  # noqa: E402
import compare_policies  # noqa: E402
from make_workload import make_workload  # noqa: E402


@pytest.mark.parametrize("script", [compare_block_sizes, compare_policies])
def test_help(script, capsys):
    with pytest.raises(SystemExit) as exit_:
        script.main(["--help"])
    assert exit_.value.code == 0 and "usage" in capsys.readouterr().out


def test_make_workload_is_seeded_and_fits_the_context():
    a, b = make_workload(50, seed=3), make_workload(50, seed=3)
    assert a == b and a != make_workload(50, seed=4)
    lengths = [len(r["prompt_token_ids"]) + r["max_new_tokens"] for r in a["requests"]]
    assert max(lengths) <= 2048 and a["total_output_tokens"] == sum(r["max_new_tokens"] for r in a["requests"])
    # Long-tailed: the mean well above the median.
    prompts = sorted(len(r["prompt_token_ids"]) for r in a["requests"])
    assert sum(prompts) / len(prompts) > prompts[len(prompts) // 2]


def test_compare_block_sizes_smallest(tmp_path):
    path = tmp_path / "w.json"
    path.write_text(json.dumps(make_workload(10, seed=0)))
    compare_block_sizes.main(["--workload", str(path), "--block-sizes", "16", "--kv-tokens", "4096",
                              "--out-dir", str(tmp_path)])
    (rows,) = json.loads((tmp_path / "block_sizes.json").read_text()).values()
    paged, tgi, static = rows
    for row in rows:
        assert 0 <= row["used"] <= 1 and row["peak_seqs"] >= 1
    # Contiguous reservations never beat paged blocks on waste, nor on sequences held at once.
    assert static["used"] <= tgi["used"] <= paged["used"]
    assert static["peak_seqs"] <= tgi["peak_seqs"] <= paged["peak_seqs"]
    assert 0 <= paged["prefix_hit"] <= 1 and paged["preemptions"] >= 0
    assert (tmp_path / "block_sizes.png").read_bytes()[:4] == b"\x89PNG"
    assert "| paged, block 16 |" in (tmp_path / "block_sizes.md").read_text()


def test_compare_policies_smallest(tmp_path):
    compare_policies.main(["--num-requests", "8", "--max-num-batched-tokens", "2048", "--max-num-seqs", "4",
                           "--kv-tokens", "4096", "--out-dir", str(tmp_path)])
    rows = json.loads((tmp_path / "policies.json").read_text())
    assert {r["policy"] for r in rows} == {"fcfs", "priority", "shortest_prompt_first"}
    for r in rows:
        assert 0 <= r["ttft_p50"] <= r["ttft_p99"] <= r["e2e_p99"]
        assert 0 < r["tpot_p50"] <= r["tpot_p99"] and r["throughput"] > 0 and r["queue_max"] >= 0
    # Same requests, different order: every request generates all its tokens under every policy, so
    # on the same step-cost clock no policy's throughput is far from another's.
    throughputs = [r["throughput"] for r in rows]
    assert max(throughputs) < 1.5 * min(throughputs)
    assert (tmp_path / "policies.png").read_bytes()[:4] == b"\x89PNG"


def test_compare_policies_rows_are_the_same_from_two_processes(tmp_path):
    smallest = ["--num-requests", "8", "--max-num-batched-tokens", "2048", "--max-num-seqs", "4", "--kv-tokens", "4096"]
    for jobs in ("1", "2"):
        compare_policies.main([*smallest, "--jobs", jobs, "--out-dir", str(tmp_path / jobs)])
    assert (tmp_path / "1" / "policies.json").read_text() == (tmp_path / "2" / "policies.json").read_text()
