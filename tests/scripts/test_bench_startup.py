"""scripts/bench_startup.py: the instrument behind the README's start-up figures, run on a tiny model."""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parents[2] / "scripts"))
import bench_startup  # noqa: E402


def test_cold_then_warm_runs_answer_alike(tiny_chat_folder, tmp_path):
    out = tmp_path / "startup.json"
    figures = bench_startup.main(["--model", str(tiny_chat_folder), "--max-tokens", "4", "--warm-runs", "1",
                                  "--json", str(out)])
    assert out.exists() and figures["answer"] and figures["machine"]["cores"] >= 1
    assert 0 < figures["cold_cpu_s"] and 0 < figures["cold_first_token_s"]
    assert len(figures["warm_first_token_s"]) == 1 and figures["warm_first_token_median_s"] > 0
