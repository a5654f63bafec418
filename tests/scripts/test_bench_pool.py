"""scripts/bench_pool.py: the scheduling host time per step, at each pool size asked for."""

import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parents[2] / "scripts"))
import bench_pool  # noqa: E402


def test_reports_a_time_per_step_for_each_pool_size(tmp_path, capsys):
    workload = tmp_path / "w.json"
    requests = [dict(prompt_token_ids=list(range(2, 2 + n)), max_new_tokens=m) for n, m in [(20, 4), (37, 6)]]
    workload.write_text(json.dumps(dict(requests=requests)))
    figures = bench_pool.main(["--workload", str(workload), "--num-blocks", "64", "4097", "--rounds", "1"])
    assert set(figures) == {64, 4097} and all(ms > 0 for ms in figures.values())
    assert "num_blocks    4097" in capsys.readouterr().out
