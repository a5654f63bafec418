"""scripts/bench_throughput.py on a tiny random model: the timed run is one LLM.generate call that
computes every prompt, and a run that found its prompts in the prefix cache says so."""

import json
import pathlib
import sys

import numpy as np
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parents[2] / "scripts"))
import bench_throughput  # noqa: E402

OPTIONS = ["--max-num-seqs", "4", "--max-num-batched-tokens", "64", "--block-size", "16"]


@pytest.fixture(scope="module")
def workload(tmp_path_factory):
    rng = np.random.default_rng(1)
    path = tmp_path_factory.mktemp("workload") / "tiny.json"
    path.write_text(json.dumps({"name": "tiny", "requests": [
        dict(prompt_token_ids=rng.integers(1, 320, size=n).tolist(), max_new_tokens=m)
        for n, m in zip((40, 21, 50, 33), (6, 3, 5, 4))]}))
    return path


def test_the_timed_run_computes_every_prompt_and_names_the_machine(tiny_checkpoint, workload, tmp_path):
    folder, _ = tiny_checkpoint("smollm2")
    out = tmp_path / "w.json"
    figures = bench_throughput.main(["--model", str(folder), "--workload", str(workload), *OPTIONS,
                                     "--json", str(out)])
    assert json.loads(out.read_text()) == figures
    assert figures["prefix_hit_tokens"] == 0 and figures["compiles_after_warmup"] == 0
    assert figures["output_tokens"] == 6 + 3 + 5 + 4 and figures["output_tokens_per_s"] > 0
    assert figures["machine"]["cpu_model"] and figures["machine"]["cores"] >= 1


def test_a_run_over_a_warm_prefix_cache_is_flagged_and_answers_alike(tiny_checkpoint, workload):
    folder, _ = tiny_checkpoint("smollm2")
    args = bench_throughput.parse_args(["--model", str(folder), "--workload", str(workload), *OPTIONS])
    _, requests, params = bench_throughput.workload_requests(args)
    engine = bench_throughput.make_engine(args)
    first = bench_throughput.run_workload(engine, requests, params)
    again = bench_throughput.run_workload(engine, requests, params)  # the prompts' blocks are still cached
    assert first.prefix_hit_tokens == 0
    # Every full 16-token block of each prompt but the block holding its last token: 32 + 16 + 48 + 32.
    assert again.prefix_hit_tokens == 128
    assert again.token_ids == first.token_ids and [len(t) for t in first.token_ids] == [6, 3, 5, 4]
