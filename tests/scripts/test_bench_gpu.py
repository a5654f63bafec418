"""scripts/bench_gpu.py where no GPU is: every part on the CPU with tiny models of the same structure;
the same weights in transformers give the engine's greedy tokens; and the Llama-3.1-8B engine's model
call, as the script builds it, lowered for CUDA with the Pallas kernel."""

import functools
import importlib.util
import json
import pathlib
import sys
import types

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

sys.path.insert(0, str(pathlib.Path(__file__).parents[2] / "scripts"))
import bench_gpu  # noqa: E402  (a script beside gpu_check.py and bench_throughput.py, which it imports)
import bench_gpu_models  # noqa: E402

from paged_jax import LLM, EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from paged_jax.core import model_runner, step_programs# noqa: E402
from paged_jax.core.resolve import resolve  # noqa: E402

HAS_TORCH = importlib.util.find_spec("torch") is not None


def test_every_part_passes_on_the_cpu(capsys, tmp_path):
    workload = tmp_path / "w.json"
    requests = [dict(id=i, prompt_token_ids=list(range(100 + i, 100 + i + n)), max_new_tokens=m)
                for i, (n, m) in enumerate([(20, 4), (37, 6), (5, 3)])]
    workload.write_text(json.dumps(dict(name="tiny", requests=requests)))
    parts = bench_gpu.PARTS if HAS_TORCH else tuple(p for p in bench_gpu.PARTS if p != "hf")
    argv = ["--platform", "cpu", "--quick", "--workload", str(workload), "--parts", ",".join(parts)]
    assert bench_gpu.main(argv) == 0
    out = capsys.readouterr().out
    for steps in (1, 8):  # one decode step a dispatch, and multi-step decode
        assert (f"[PASS] w1_steps{steps}: model random, SmolLM2's shape, num_scheduler_steps {steps}, "
                "output_tokens_per_s") in out
    assert out.count("output_tokens 13,") == 2
    for n, context in bench_gpu.QUICK.sweep:
        assert f"[PASS] sweep {n} x {context}: kv_mb_read" in out
    assert "[PASS] llama-3.1-8b decode: seqs_x_context 8 x 128, step_ms" in out
    assert "[PASS] llama-3.1-8b prefill: tokens 256, step_ms" in out
    if HAS_TORCH:
        assert "[PASS] vs transformers: requests_x_prompt_x_new 4 x 16 x 8, ours_tok_per_s" in out
    assert f"{len(parts) + 3} passed, 0 failed, 0 skipped" in out  # w1, the sweep and llama8b print two lines each


def test_a_part_that_raises_fails_alone(capsys):
    def broken():
        raise ValueError("no")

    assert [r.verdict for r in bench_gpu.record("x", broken)] == ["FAIL"]
    assert [r.verdict for r in bench_gpu.record("y", lambda: (_ for _ in ()).throw(bench_gpu.Skip("not here")))] == [
        "SKIP"]
    out = capsys.readouterr().out
    assert "[FAIL] x: error ValueError: no" in out and "[SKIP] y: why not here" in out


@pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed")
def test_transformers_holds_the_engines_weights():
    """Float32 on both sides: the same greedy tokens, so hf_tensors ran the weight table backwards right
    (q/k/v and gate/up out of their fused parameters, llama3 rope scaling on both)."""
    import torch

    hf = bench_gpu_models.hf_config("llama-3.1-8b", tiny=True)
    config = bench_gpu_models.model_config(hf)
    model = bench_gpu_models.random_model(config, dtype=jnp.float32)
    prompt = list(range(7, 30))
    engine = LLMEngine(model, config, None, EngineConfig(num_blocks=16, block_size=16, max_model_len=64,
                                                        matmul_backend="xla"))  # no C++ matmul to build and time
    ours = LLM.from_engine(engine).generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                                            use_tqdm=False)[0].outputs[0].token_ids
    hf_model = bench_gpu_models.transformers_model(model, hf)
    theirs = hf_model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert list(ours) == theirs[0, len(prompt):].tolist()


def test_the_8b_model_call_lowers_for_cuda_with_the_pallas_kernel():
    """The script's decode and prefill batches on Llama-3.1-8B's shape, weights abstract (nothing of 16 GB
    is made), through the runner the engine would build on a GPU."""
    config = bench_gpu_models.model_config(bench_gpu_models.hf_config("llama-3.1-8b"))
    model = nnx.eval_shape(lambda: bench_gpu_models.random_model(config))
    # Meta's count for Llama-3.1-8B: the shipped config is its config.json.
    assert sum(a.size for a in jax.tree.leaves(nnx.state(model, nnx.Param))) == 8_030_261_248
    assert bench_gpu_models.weight_bytes(model) == 2 * (8_030_261_248 - 2 * 128256 * 4096)  # less embed, lm_head
    options = bench_gpu.engine_options(bench_gpu.QUICK)
    resolved = resolve(EngineConfig(**options), config, types.SimpleNamespace(platform="gpu"), jnp.bfloat16)
    assert resolved.attention_backend == "pallas"
    runner = model_runner.ModelRunner(model, config, resolved)
    (seqs, context), tokens = bench_gpu.QUICK.decode, bench_gpu.QUICK.prefill
    pages = f"tensor<{options['num_blocks']}x16x8x128xbf16>"
    batch = functools.partial(bench_gpu_models.scheduled_batch, vocab=config.vocab_size,
                              block_size=bench_gpu.BLOCK_SIZE)
    for scheduled in (batch(seqs, context, 1), batch(1, tokens, tokens)):
        (graph, *arrays), keywords = runner.step_args(scheduled)
        abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), arrays)
        text = step_programs.step.trace(graph, *abstract, **keywords).lower(lowering_platforms=("cuda",)).as_text()
        assert "__gpu$xla.gpu.triton" in text, "the model call must run the Pallas Triton kernel"
        assert "tensor<4096x8x6x128xbf16>" in text, "q/k/v fused per KV head: 32 heads over 8, head_dim 128"
        assert text.count(pages) >= 2 * config.num_layers, "every layer's K and V pages"
