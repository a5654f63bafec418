"""scripts/bench_peers.py: the side-by-side instrument on a tiny random model, transformers as the peer
(vLLM lives in a virtualenv of its own, not in CI), and the step profile it prints."""

import json
import pathlib
import sys

import numpy as np
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parents[2] / "scripts"))
import bench_peers  # noqa: E402


def test_rounds_ratios_agreement_a_precision_row_and_a_profile_that_adds_up(tiny_checkpoint, tmp_path):
    folder, _ = tiny_checkpoint("smollm2")
    rng = np.random.default_rng(0)
    workload = tmp_path / "tiny.json"
    workload.write_text(json.dumps({"name": "tiny", "requests": [
        dict(prompt_token_ids=rng.integers(1, 320, size=int(n)).tolist(), max_new_tokens=m)
        for n, m in zip((20, 40, 9, 33), (8, 4, 8, 4))]}))
    out = tmp_path / "peers.json"
    figures = bench_peers.main(["--model", str(folder), "--workload", str(workload), "--rounds", "2",
                                "--peers", "transformers", "--max-num-seqs", "4", "--max-num-batched-tokens", "64",
                                "--check-requests", "4", "--check-tokens", "4", "--precisions", "kv-bf16", "--profile",
                                "--json", str(out)])
    saved = json.loads(out.read_text())
    assert saved["median_ratio"] == figures["median_ratio"]
    assert saved["machine"]["cpu_model"] and saved["machine"]["cores"] >= 1
    assert len(figures["rounds"]) == 2 and all(row["paged-jax"] > 0 and row["transformers"] > 0
                                               for row in figures["rounds"])
    assert len(figures["ratios"]["transformers"]) == 2 and figures["median_ratio"]["transformers"] > 0
    check = figures["token_agreement"]["transformers"]
    assert len(check["matching_prefix"]) == 4 and check["agreement"] >= 0.75
    # The precision row: every round beside float32, its ratios, its agreement with float32's tokens.
    assert all(row["paged-jax kv-bf16"] > 0 for row in figures["rounds"]) and figures["prefix_hit_tokens"] == [0, 0]
    assert len(figures["precision_ratios"]["paged-jax kv-bf16 / transformers"]) == 2
    assert figures["token_agreement"]["paged-jax kv-bf16"]["agreement"] >= 0.75

    profile = figures["profile"]
    assert profile["model_steps"] > 0 and profile["parts_s"]["matmul"] > 0 and profile["parts_s"]["attention"] > 0
    # The parts come from the trace, the step times from the clock: they must agree.
    assert abs(profile["parts_sum_s"] - profile["model_steps_s"]) <= 0.05 * profile["model_steps_s"] + 0.005
    for group in profile["groups"]:
        assert abs(sum(group["parts_s"].values()) - group["seconds"]) <= 0.05 * group["seconds"] + 0.005
        # A tiny model is far from this machine's limits, but its steps still read every weight once.
        assert profile["weight_bytes"] / (profile["memory_bandwidth_gbs"] * 1e9) * group["steps"] <= group["floor_s"] * 1.001
        assert group["floor_s"] < group["seconds"]
    groups = profile["groups"]
    assert profile["floor_s"] == pytest.approx(sum(g["floor_s"] for g in groups), abs=1e-9 * len(groups))
    assert {g["kind"] for g in profile["groups"]} == {"prefill", "decode"}
