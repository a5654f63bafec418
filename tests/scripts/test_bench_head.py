"""scripts/bench_head.py: the greedy head four ways, which must agree on the tokens, each timed."""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parents[2] / "scripts"))
import bench_head


def test_times_each_way_for_each_case(capsys):
    figures = bench_head.main(["--rows", "3:4", "4:4", "--rounds", "1", "--vocab", "1000"])
    assert set(figures) == {"3:4", "4:4"}
    assert all(set(ms) == {"engine", "logits", "+ ban", "+ ban + padding"} and min(ms.values()) > 0 for ms in figures.values())
    out = capsys.readouterr().out
    assert "machine: " in out and "3 live of 4 rows" in out and "before / now" in out
