"""scripts/gpu_check.py where no GPU is: its parts on the CPU, the Pallas kernel run by the Pallas
interpreter in place of the compiled one (kernel cases, the engine's tokens against the CPU engine's,
decode bandwidth, W1 on a tiny model), and the verdicts of its token comparison."""

import json
import pathlib
import sys

import jax
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parents[2] / "scripts"))
import gpu_check  # noqa: E402  (a script beside bench_throughput.py, which it imports)


def test_quick_check_passes_on_the_cpu(capsys):
    assert gpu_check.main(["--platform", "cpu", "--quick", "--tiny-prompts", "3", "--steps", "6"]) == 0
    out = capsys.readouterr().out
    assert out.count("[PASS] kernel ") == 2
    assert "[PASS] tokens tiny-llama: prompts 3, identical 3" in out
    assert "3 of 3 passed" in out


@pytest.mark.skipif(any(d.platform == "gpu" for d in jax.devices()), reason="a GPU is here")
def test_without_a_gpu_the_check_fails_and_says_why(capsys):
    assert gpu_check.main(["--quick"]) == 1
    assert "no GPU visible to JAX" in capsys.readouterr().out


def generation(tokens, runner_up_gap):
    """One prompt whose reference put `runner_up_gap` between its token and token 9 at every step."""
    return gpu_check.Generation([tokens], [[{t: -0.1, 9: -0.1 - runner_up_gap} for t in tokens]])


@pytest.mark.parametrize("checked, gap, ok, near_ties", [
    ([1, 2, 3], 1.0, True, 0),  # identical
    ([1, 9, 5], 1e-5, True, 1),  # first differs where the reference nearly tied: rounding, not a bug
    ([1, 9, 5], 0.5, False, 0),  # first differs where the reference was sure
])
def test_token_comparison_verdicts(checked, gap, ok, near_ties):
    result = gpu_check.compare_tokens("t", gpu_check.Generation([checked], [[]]), generation([1, 2, 3], gap))
    assert result.ok is ok and result.figures["near_ties"] == near_ties


def test_decode_bandwidth_reports_its_figures():
    result = gpu_check.decode_bandwidth(interpret=True, num_seqs=4, context=64, repeats=2)
    assert result.ok and result.figures["kv_mb_read"] == round(2 * 4 * 64 * 3 * 64 * 2 / 1e6, 1)
    assert result.figures["kv_gb_per_s"] > 0 and result.figures["copy_gb_per_s"] > 0


def test_w1_part_runs_bench_throughput_in_bfloat16(tiny_checkpoint, tmp_path):
    folder, _ = tiny_checkpoint("smollm2")
    workload = tmp_path / "w.json"
    requests = [dict(id=i, prompt_token_ids=list(range(2, 2 + n)), max_new_tokens=m)
                for i, (n, m) in enumerate([(20, 4), (37, 6), (5, 3)])]
    workload.write_text(json.dumps(dict(name="tiny", requests=requests)))
    result = gpu_check.check_w1(str(folder), str(workload), num_requests=2)
    assert result.ok and result.figures["output_tokens"] == 10 and result.figures["dtype"] == "bfloat16"
    assert result.figures["mfu"] > 0


def test_decode_against_jax_kernel_agrees_and_times_both():
    """Both kernels through the Pallas interpreter: JAX's own decode kernel is the independent reference."""
    result = gpu_check.decode_against_jax_kernel(interpret=True, num_seqs=4, context=256, repeats=1)
    assert result.ok and float(result.figures["rel_diff"]) < 1e-2
    assert result.figures["ours_us"] > 0 and result.figures["jax_us"] > 0
