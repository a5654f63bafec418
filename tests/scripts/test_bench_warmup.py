"""scripts/bench_warmup.py: a cold warm-up timed with its programs compiled side by side and one at a
time, on a tiny model: the same programs either way."""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parents[2] / "scripts"))
import bench_warmup  # noqa: E402


def test_both_modes_make_the_same_programs(tiny_chat_folder):
    rows = bench_warmup.main(["--model", str(tiny_chat_folder)])
    assert [r["mode"] for r in rows] == ["parallel", "serial"]
    assert rows[0]["programs"] == rows[1]["programs"] > 0
    assert rows[1]["workers"] == 1 and all(r["seconds"] > 0 for r in rows)
