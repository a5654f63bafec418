"""scripts/bench_structured.py on a tiny model and a three-request workload: both runs generate alike,
the constrained rows' host time is measured, and a schema compiles while steps run."""

import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parents[2] / "scripts"))
import bench_structured  # noqa: E402


def test_runs_side_by_side_and_times_a_compile(tiny_chat_folder, tmp_path):
    workload = tmp_path / "w.json"
    requests = [dict(id=i, prompt_token_ids=list(range(100 + i, 140 + i)), max_new_tokens=24) for i in range(3)]
    workload.write_text(json.dumps(dict(name="tiny", requests=requests)))
    figures = bench_structured.main(["--model", str(tiny_chat_folder), "--workload", str(workload),
                                     "--constrained-every", "2", "--compile-properties", "40",
                                     "--json", str(tmp_path / "out.json")])
    assert figures["constrained_requests"] == 2
    # The constraint keeps its requests going to max_new_tokens, as ignore_eos keeps the others.
    assert figures["constrained"]["output_tokens"] == figures["unconstrained"]["output_tokens"] == 72
    assert figures["constrained"]["host_us_per_constrained_row_step"] > 0
    assert "host_us_per_constrained_row_step" not in figures["unconstrained"]
    assert figures["while_compiling"]["steps_during_compile"] >= 1
    assert json.loads((tmp_path / "out.json").read_text()) == figures
