"""scripts/bench_moe.py: a row per decode batch with both backends' MoE and dense step times, and what
ragged_dot lowers to on this backend (its figures are the docs'; here only that it runs and says so)."""

import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parents[2] / "scripts"))
import bench_moe  # noqa: E402


def test_reports_moe_against_dense_per_backend(tmp_path):
    out = tmp_path / "moe.json"
    result = bench_moe.main(["--hidden", "64", "--expert-width", "32", "--layers", "1", "--vocab", "256",
                             "--decodes", "1,3", "--context", "9", "--repeats", "1", "--json", str(out)])
    assert json.loads(out.read_text()) == result
    assert [row["decoding"] for row in result["steps"]] == [1, 3]
    for row in result["steps"]:
        assert all(row[f"{model}_{backend}_ms"] > 0 for model in ("moe", "dense") for backend in ("cpu", "xla"))
        assert row["ratio_cpu"] > 0 and row["ratio_xla"] > 0
    # On the CPU JAX hands XLA no ragged_dot instruction.
    assert result["ragged_dot_lowering"].startswith("no ragged_dot instruction")
