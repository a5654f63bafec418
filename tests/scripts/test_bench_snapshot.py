"""scripts/bench_snapshot.py, the instrument behind the dashboard's snapshot cost, on a tiny model."""

import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parents[2] / "scripts"))
import bench_snapshot  # noqa: E402


def test_times_a_snapshot_after_every_step(tiny_chat_folder, tmp_path):
    workload = tmp_path / "workload.json"
    requests = [dict(id=i, prompt_token_ids=list(range(1000 + i, 1040 + 9 * i)), max_new_tokens=12) for i in range(6)]
    workload.write_text(json.dumps(dict(requests=requests)))
    figures = bench_snapshot.main(["--model", str(tiny_chat_folder), "--workload", str(workload), "--max-tokens", "8",
                                   "--block-size", "16", "--json", str(tmp_path / "out.json")])
    assert json.loads((tmp_path / "out.json").read_text()) == figures
    # Every request was in flight at some step; each step, and so each snapshot, was timed.
    assert figures["max_sequences_in_a_snapshot"] == 6 and figures["steps"] >= 8
    assert 0 < figures["snapshot_ms_median"] <= figures["snapshot_ms_p99"]
    assert figures["step_ms_median"] > 0 and figures["snapshot_per_step_percent"] > 0
