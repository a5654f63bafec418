"""Where an engine step's time goes, read from a JAX profiler trace of the real steps.

`profile_run(engine, requests, params)` runs the requests once under `jax.profiler`, each engine step
inside a trace annotation, and splits every step's wall time into
- matmul: the model's matmuls outside attention (q/k/v, o, gate/up, down, the lm_head): XLA dots,
  each an op whose compiled HLO is a dot or a fusion around one, or the C++ matmul over packed
  weights, under the named scope "matmul";
- attention: ops under the model's named scope "attention" (the C++ decode kernel, the XLA query
  tiles of prefill rows);
- kv_write: ops under the named scope "kv_write" (the step's K/V into its pages);
- other: every other XLA op (norms, rotary, SwiGLU's product, the embedding gather, the sampler,
  the block pool's small programs);
- host: no XLA op running (scheduling, building the batch, Python, the device-to-host copy).
Ops are told apart by the compiled step's HLO (hlo_parts.py), which the trace's op names point into;
the trace gives each op's seconds in each step (trace_ops.py), split evenly where XLA runs ops on both
threads at once, so the parts add up to the step's wall time.

Steps are grouped: prefill-carrying steps by their token bucket T, decode-only steps by their
sampled rows' bucket S (buckets.py). A step is two programs (the model call, then the head and the
sampler), both read from the trace. Prefill is rated in GFLOP/s (model FLOPs of the step's real tokens),
decode in GB/s (weights + the K/V the step reads), against a matmul peak and a memory bandwidth
measured in the same process (machine_peaks.py). The trace slows steps a little: the profiled run's tokens/s is reported
beside the profile so that the distortion shows.

Each group also gets a floor: the least time its steps could take on this machine, whatever the code.
A step's matmuls take their FLOPs at the matmul peak or their weights read once at the bandwidth,
whichever is longer; its attention reads each row's K/V once at the bandwidth or does its FLOPs at
the peak, whichever is longer; nothing else (norms, the sampler, the host) costs anything. The
measured time over the floor says how much any kernel, fusion or scheduling work could still gain.
"""

import collections
import dataclasses
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp

from paged_jax.core import step_programs
from paged_jax.research import hlo_parts, machine_peaks, trace_ops

PARTS = ("matmul", "attention", "kv_write", "other", "host")
# The step's two programs (core/model_runner.py): the model call, then the head and the sampler.
_STEP_MODULES = {"jit_step": step_programs.step, "jit_sample_step": step_programs.sample_step}


@dataclasses.dataclass
class _Step:
    kind: str  # "prefill" (some row has several new tokens) or "decode"
    bucket: int  # T for prefill, S for decode
    tokens: int  # real new tokens
    seqs: int
    context_tokens: int  # sum over rows of the context each attends over
    attention_pairs: int  # sum over new tokens of the context they attend over
    signature: dict  # what each of the step's programs was compiled for, by module
    wall_s: float = 0.0


def _abstract(args, keywords):
    """The step's arguments as shapes, dtypes and shardings: enough to lower it again."""
    as_shape = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) if isinstance(x, jax.Array) else x
    graph, *arrays = args
    return graph, jax.tree.map(as_shape, tuple(arrays)), keywords


def _signature_key(abstract) -> str:
    _, arrays, keywords = abstract
    return str(jax.tree.map(lambda x: (x.shape, str(x.dtype)), arrays)) + str(sorted(keywords.items(), key=str))


def profile_run(engine, requests, params, *, matmul_peak: float | None = None,
                bandwidth: float | None = None) -> dict:
    """Run `requests` (dicts with "prompt_token_ids") with `params` under the profiler; the profile
    as a dict (format_profile prints it). The engine must have run such requests before: a compile
    inside a profiled step would count as its time."""
    if engine.resolved.platform != "cpu":
        raise ValueError(f"the step profile attributes XLA's op events on the host CPU; this engine runs on "
                         f"{engine.resolved.platform} (read jax.profiler's trace in XProf there)")
    runner = engine.runner
    steps: list[_Step] = []
    programs: dict[str, tuple] = {}  # signature -> (module, abstract arguments)
    hidden_of: dict[str, jax.ShapeDtypeStruct] = {}  # the model call's output, by its signature

    def record(scheduled):
        args, keywords = runner.step_args(scheduled)
        abstract = _abstract(args, keywords)
        key = _signature_key(abstract)
        if key not in programs:
            out = step_programs.step.trace(abstract[0], *abstract[1], **keywords).lower().out_info[0]
            programs[key] = ("jit_step", abstract)
            hidden_of[key] = jax.ShapeDtypeStruct(out.shape, out.dtype)
        tensors = runner.inputs.step(scheduled)[1]
        sample = _abstract(*runner.sample_args(hidden_of[key], tensors))
        sample_key = _signature_key(sample)
        programs.setdefault(sample_key, ("jit_sample_step", sample))
        new = [s.num_new_tokens for s in scheduled]
        contexts = [s.seq.num_computed_tokens + n for s, n in zip(scheduled, new)]
        prefill = max(new) > 1
        pairs = sum(c * n - n * (n - 1) // 2 for c, n in zip(contexts, new))
        buckets = runner.resolved.buckets
        group = buckets.token_bucket(sum(new)) if prefill else buckets.sample_rows(len(scheduled))
        steps.append(_Step("prefill" if prefill else "decode", group, sum(new), len(scheduled), sum(contexts),
                           pairs, {"jit_step": key, "jit_sample_step": sample_key}))

    engine.blocks.reset_prefix_cache()
    for i, r in enumerate(requests):
        engine.add_request(r["prompt_token_ids"], params[i])
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0
    windows = []  # per engine step: (wall seconds, whether it ran the model)
    runner.step_observers.append(record)
    folder = tempfile.TemporaryDirectory()
    produced = 0
    try:
        jax.profiler.start_trace(folder.name, profiler_options=options)
        start = time.perf_counter()
        try:
            while engine.has_unfinished_requests():
                before = len(steps)
                t = time.perf_counter()
                with jax.profiler.TraceAnnotation(f"engine_step_{len(windows)}"):
                    outputs = engine.step()
                windows.append((time.perf_counter() - t, len(steps) > before))
                produced += sum(len(o.outputs[0].token_ids) for o in outputs if o.finished)
            elapsed = time.perf_counter() - start
        finally:
            jax.profiler.stop_trace()
            runner.step_observers.remove(record)
        parts = trace_ops.op_seconds_per_step(folder.name, len(windows))
    finally:
        folder.cleanup()

    ran = [i for i, (_, model) in enumerate(windows) if model]
    for step, i in zip(steps, ran, strict=True):
        step.wall_s = windows[i][0]
    hlo = {key: hlo_parts.classify_hlo(hlo_parts.compiled_text(_STEP_MODULES[module], abstract,
                                                               scoped=module == "jit_step"))
           for key, (module, abstract) in programs.items()}
    per_step = [_assign(parts[i], {module: hlo[key] for module, key in step.signature.items()})
                for step, i in zip(steps, ran)]
    matmul_peak = matmul_peak or machine_peaks.matmul_peak_gflops()
    bandwidth = bandwidth or machine_peaks.memory_bandwidth_gbs()
    return _summarise(engine, steps, per_step, windows, elapsed, produced, matmul_peak, bandwidth)


def _assign(seconds: dict[tuple[str, str], float], parts_of: dict[str, dict[str, str]]) -> dict[str, float]:
    """Per-op seconds -> per-part seconds, with the step programs' classifications (by module)."""
    out = dict.fromkeys(PARTS, 0.0)
    for (module, op), s in seconds.items():
        if not module:
            out["host"] += s
        else:
            out[parts_of.get(module, {}).get(op, "other")] += s
    return out


def _summarise(engine, steps, per_step, windows, elapsed, produced, matmul_peak, bandwidth) -> dict:
    c = engine.model_config
    per_layer = (c.hidden_size * (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
                 + c.num_heads * c.head_dim * c.hidden_size + 3 * c.hidden_size * c.intermediate_size)
    itemsize = jnp.dtype(engine.resolved.kv_cache_dtype).itemsize
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(engine.runner.state))
    kv_bytes_per_token = c.num_layers * 2 * c.num_kv_heads * c.head_dim * itemsize

    matmul_flops = lambda s: 2 * c.num_layers * per_layer * s.tokens + 2 * c.vocab_size * c.hidden_size * s.seqs
    attention_flops = lambda s: 4 * c.num_layers * c.num_heads * c.head_dim * s.attention_pairs
    peak, read_rate = matmul_peak * 1e9, bandwidth * 1e9

    def floor(s: _Step) -> float:
        return (max(matmul_flops(s) / peak, weight_bytes / read_rate)
                + max(kv_bytes_per_token * s.context_tokens / read_rate, attention_flops(s) / peak))

    groups = collections.defaultdict(list)
    for step, parts in zip(steps, per_step):
        groups[(step.kind, step.bucket)].append((step, parts))
    rows = []
    for (kind, group), members in sorted(groups.items()):
        wall = sum(s.wall_s for s, _ in members)
        parts = {p: sum(x[p] for _, x in members) for p in PARTS}
        row = dict(kind=kind, bucket=("T=" if kind == "prefill" else "S=") + str(group), steps=len(members),
                   seconds=round(wall, 3), ms_per_step=round(1e3 * statistics.mean(s.wall_s for s, _ in members), 2),
                   parts_s={p: round(v, 6) for p, v in parts.items()},
                   tokens=sum(s.tokens for s, _ in members),
                   floor_s=round(sum(floor(s) for s, _ in members), 9))
        row["gflops"] = round(sum(matmul_flops(s) + attention_flops(s) for s, _ in members) / wall / 1e9, 1)
        row["matmul_gflops"] = round(sum(matmul_flops(s) for s, _ in members) / max(parts["matmul"], 1e-9) / 1e9, 1)
        read = sum(weight_bytes + kv_bytes_per_token * s.context_tokens for s, _ in members)
        row["gbs"] = round(read / wall / 1e9, 2)
        row["kv_gbs_in_attention"] = round(sum(kv_bytes_per_token * s.context_tokens for s, _ in members)
                                           / max(parts["attention"], 1e-9) / 1e9, 2)
        rows.append(row)
    model_s = sum(s.wall_s for s in steps)
    # Microseconds: a small model's attention can take well under a millisecond in all.
    totals = {p: round(sum(x[p] for x in per_step), 6) for p in PARTS}
    return {
        "profiled_output_tokens_per_s": round(produced / elapsed, 1),
        "wall_s": round(elapsed, 2),
        "engine_steps": len(windows),
        "model_steps": len(steps),
        "model_steps_s": round(model_s, 3),
        "other_steps_s": round(sum(w for w, model in windows if not model), 3),
        "parts_s": totals,
        "parts_sum_s": round(sum(totals.values()), 6),
        "floor_s": round(sum(floor(s) for s in steps), 9),
        "matmul_peak_gflops": round(matmul_peak, 1),
        "memory_bandwidth_gbs": round(bandwidth, 2),
        "weight_bytes": weight_bytes,
        "kv_bytes_per_token": kv_bytes_per_token,
        "groups": rows,
    }


def format_profile(profile: dict) -> str:
    """The profile as text: totals, then a row per group of steps."""
    p = profile
    total = p["model_steps_s"]
    share = lambda parts: " ".join(f"{name} {100 * parts[name] / max(sum(parts.values()), 1e-9):4.1f}%"
                                   for name in PARTS)
    lines = [
        f"profiled run: {p['profiled_output_tokens_per_s']} output tok/s, {p['wall_s']} s, {p['model_steps']} model steps "
        f"({total} s; parts add up to {p['parts_sum_s']:.3f} s)",
        f"measured here: matmul peak {p['matmul_peak_gflops']} GFLOP/s, memory read {p['memory_bandwidth_gbs']} GB/s; "
        f"weights {p['weight_bytes'] / 1e6:.0f} MB, K/V {p['kv_bytes_per_token'] / 1e3:.1f} kB per token",
        f"all model steps: {share(p['parts_s'])}",
        f"floor (matmuls at the peak or weights at the read rate, K/V read once, nothing else): {p['floor_s']:.2f} s, "
        f"measured {total / max(p['floor_s'], 1e-9):.2f}x it",
        "",
        f"{'group':<15}{'steps':>6}{'s':>8}{'ms/step':>9}{'x floor':>8}  {'parts of the time':<68}rate",
    ]
    for row in p["groups"]:
        if row["kind"] == "prefill":
            rate = f"{row['gflops']} GFLOP/s (matmuls alone {row['matmul_gflops']})"
        else:
            rate = f"{row['gbs']} GB/s (K/V in attention {row['kv_gbs_in_attention']})"
        lines.append(f"{row['kind'] + ' ' + row['bucket']:<15}{row['steps']:>6}{row['seconds']:>8.2f}"
                     f"{row['ms_per_step']:>9.1f}{row['seconds'] / max(row['floor_s'], 1e-9):>8.2f}  "
                     f"{share(row['parts_s']):<68}{rate}")
    return "\n".join(lines)
