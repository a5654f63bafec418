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
Ops are told apart by the compiled step's HLO (its instruction names and op_name metadata), which the
trace's op names point into. Where XLA runs ops on both threads at once, the time is split evenly
between them, so the parts add up to the step's wall time.

Steps are grouped: prefill-carrying steps by their token bucket T, decode-only steps by their
sequence bucket S (buckets.py). Prefill is rated in GFLOP/s (model FLOPs of the step's real tokens),
decode in GB/s (weights + the K/V the step reads), against a matmul peak and a memory bandwidth
measured in the same process. The trace slows steps a little: the profiled run's tokens/s is reported
beside the profile so that the distortion shows.
"""

import collections
import dataclasses
import re
import statistics
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from paged_jax.core import model_runner
from paged_jax.core.buckets import step_shape

PARTS = ("matmul", "attention", "kv_write", "other", "host")
_STEP_MODULE = "jit_step"


def matmul_peak_gflops(dtype=jnp.float32, n: int | None = None, repeats: int = 10) -> float:
    """Best-of n^3 matmul rate on the default device through XLA, in dtype. n: 2048 on the CPU; 8192
    on a GPU, where a smaller product ends before the launch overhead is amortised."""
    if n is None:
        n = 8192 if jax.default_backend() == "gpu" else 2048
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32).astype(dtype)
    return 2 * n**3 / _best_time(jax.jit(lambda x, y: x @ y), (a, a), repeats) / 1e9


def memory_bandwidth_gbs(megabytes: int = 512, repeats: int = 10) -> float:
    """Best-of read rate of a float32 array far larger than the caches, summed by XLA (GB/s)."""
    x = jnp.ones(megabytes * 2**20 // 4, jnp.float32)
    return x.nbytes / _best_time(jax.jit(jnp.sum), (x,), repeats) / 1e9


def _best_time(f, args, repeats: int) -> float:
    jax.block_until_ready(f(*args))
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(f(*args))
        best = min(best, time.perf_counter() - t)
    return best


# The compiled step's HLO: which op is which part.

_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+) = .*?\s([\w\-]+)\(")
_COMPUTATION = re.compile(r"^\s*(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")


def classify_hlo(text: str) -> dict[str, str]:
    """Instruction name -> part, for every instruction of a compiled module's HLO text."""
    calls, metadata, opcode, has_dot = {}, {}, {}, collections.defaultdict(bool)
    computation = None
    for line in text.splitlines():
        if (m := _INSTRUCTION.match(line)) is None:
            if (c := _COMPUTATION.match(line)) is not None:
                computation = c.group(1)
            continue
        name = m.group(1)
        opcode[name] = m.group(2)
        metadata[name] = (re.search(r'op_name="([^"]*)"', line) or [None, ""])[1]
        calls[name] = re.findall(r"(?:calls|body|condition|to_apply)=%?([\w.\-]+)", line)
        if m.group(2) in ("dot", "convolution"):
            has_dot[computation] = True

    def part(name: str) -> str:
        scope = metadata[name]
        if "attention" in scope:
            return "attention"
        if "kv_write" in scope:
            return "kv_write"
        if "matmul" in scope or opcode[name] in ("dot", "convolution") or (
                opcode[name] == "fusion" and any(has_dot[c] for c in calls[name])):
            return "matmul"
        return "other"

    return {name: part(name) for name in opcode}


# The run.

@dataclasses.dataclass
class _Step:
    kind: str  # "prefill" (some row has several new tokens) or "decode"
    bucket: int  # T for prefill, S for decode
    tokens: int  # real new tokens
    seqs: int
    context_tokens: int  # sum over rows of the context each attends over
    attention_pairs: int  # sum over new tokens of the context they attend over
    signature: object  # what the step's program was compiled for
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
    runner = engine.runner
    steps: list[_Step] = []
    programs: dict[str, tuple] = {}
    execute = runner.execute

    def recording_execute(scheduled, copies):
        args, keywords = runner.step_args(scheduled)
        abstract = _abstract(args, keywords)
        key = _signature_key(abstract)
        programs.setdefault(key, abstract)
        new = [s.num_new_tokens for s in scheduled]
        contexts = [s.seq.num_computed_tokens + n for s, n in zip(scheduled, new)]
        shape = step_shape(sum(new), len(scheduled), max(len(s.seq.block_ids) for s in scheduled), max(new))
        prefill = shape.max_query_len > 1
        pairs = sum(c * n - n * (n - 1) // 2 for c, n in zip(contexts, new))
        steps.append(_Step("prefill" if prefill else "decode", shape.num_tokens if prefill else shape.num_seqs,
                           sum(new), len(scheduled), sum(contexts), pairs, key))
        return execute(scheduled, copies)

    engine.blocks.reset_prefix_cache()
    for i, r in enumerate(requests):
        engine.add_request(r["prompt_token_ids"], params[i])
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0
    windows = []  # per engine step: (wall seconds, whether it ran the model)
    runner.execute = recording_execute
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
            del runner.execute  # the class's method again
        parts = _parts_per_step(folder.name, len(windows))
    finally:
        folder.cleanup()

    ran = [i for i, (_, model) in enumerate(windows) if model]
    for step, i in zip(steps, ran, strict=True):
        step.wall_s = windows[i][0]
    hlo = {key: classify_hlo(_compiled_text(abstract)) for key, abstract in programs.items()}
    per_step = [_assign(parts[i], hlo[step.signature]) for step, i in zip(steps, ran)]
    matmul_peak = matmul_peak or matmul_peak_gflops()
    bandwidth = bandwidth or memory_bandwidth_gbs()
    return _summarise(engine, steps, per_step, windows, elapsed, produced, matmul_peak, bandwidth)


def _compiled_text(abstract) -> str:
    """The optimized HLO of the step for these arguments (the traced run's op names point into it)."""
    graph, arrays, keywords = abstract
    text = model_runner.step.lower(graph, *arrays, **keywords).compile().as_text()
    if "kv_write" not in text or "attention" not in text:
        # The persistent compilation cache's key leaves out op metadata: a program cached before the
        # model's named scopes were added comes back without them.
        raise RuntimeError("the compiled step lacks the model's named scopes 'attention' and 'kv_write': the "
                           "persistent compilation cache holds it from older code; profile with a fresh one "
                           "(JAX_COMPILATION_CACHE_DIR=/some/new/folder) or clear it")
    return text


def _parts_per_step(folder: str, num_steps: int) -> list[dict[tuple[str, str], float]]:
    """Per engine step, seconds keyed by (HLO module, op name), "" for host time: each thread's
    innermost op at each instant, time shared evenly by the ops running at once."""
    from jax.profiler import ProfileData

    path = next(Path(folder).rglob("*.xplane.pb"))
    plane = ProfileData.from_file(str(path)).find_plane_with_name("/host:CPU")
    windows = [None] * num_steps
    threads = []
    for line in plane.lines:
        if line.name == "python":
            for e in line.events:
                if e.name.startswith("engine_step_"):
                    windows[int(e.name[len("engine_step_"):])] = (e.start_ns, e.end_ns)
        else:
            ops = []
            for e in line.events:
                stats = dict(e.stats)
                if "hlo_op" in stats:
                    ops.append((e.start_ns, e.end_ns, (stats.get("hlo_module", ""), stats["hlo_op"])))
            threads.append(ops)
    segments = sorted(s for ops in threads for s in _innermost(ops))
    out = []
    cursor = 0
    for start, end in windows:
        while cursor < len(segments) and segments[cursor][1] <= start:
            cursor += 1
        inside = []
        for s in segments[cursor:]:
            if s[0] >= end:
                break
            inside.append((max(s[0], start), min(s[1], end), s[2]))
        out.append(_share(inside, start, end))
    return out


def _innermost(ops: list[tuple[int, int, tuple]]) -> list[tuple[int, int, tuple]]:
    """One thread's op events (nested: a loop holds its body's ops) as non-overlapping segments,
    each instant given to the innermost op running then."""
    out, stack, t = [], [], 0
    for start, end, key in sorted(ops, key=lambda e: (e[0], -e[1])):
        while stack and stack[-1][0] <= start:
            done, owner = stack.pop()
            out.append((t, done, owner))
            t = done
        if stack:
            out.append((t, start, stack[-1][1]))
            end = min(end, stack[-1][0])
        stack.append((end, key))
        t = start
    while stack:
        done, owner = stack.pop()
        out.append((t, done, owner))
        t = done
    return [s for s in out if s[1] > s[0]]


def _share(segments, start: int, end: int) -> dict[tuple[str, str], float]:
    """Seconds per op over [start, end]: each instant split evenly among the ops running; "" none."""
    edges = sorted({start, end, *(s[0] for s in segments), *(s[1] for s in segments)})
    events = collections.defaultdict(list)
    for s in segments:
        events[s[0]].append((1, s[2]))
        events[s[1]].append((-1, s[2]))
    active: collections.Counter = collections.Counter()
    seconds: dict = collections.defaultdict(float)
    for a, b in zip(edges, edges[1:]):
        for sign, key in events.get(a, ()):
            active[key] += sign
            if active[key] == 0:
                del active[key]
        n = sum(active.values())
        if n == 0:
            seconds[("", "")] += (b - a) / 1e9
        for key, count in active.items():
            seconds[key] += (b - a) / 1e9 * count / n
    return seconds


def _assign(seconds: dict[tuple[str, str], float], parts_of: dict[str, str]) -> dict[str, float]:
    """Per-op seconds -> per-part seconds, with the step program's classification."""
    out = dict.fromkeys(PARTS, 0.0)
    for (module, op), s in seconds.items():
        if not module:
            out["host"] += s
        elif module == _STEP_MODULE:
            out[parts_of.get(op, "other")] += s
        else:
            out["other"] += s
    return out


def _summarise(engine, steps, per_step, windows, elapsed, produced, matmul_peak, bandwidth) -> dict:
    c = engine.model_config
    per_layer = (c.hidden_size * (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
                 + c.num_heads * c.head_dim * c.hidden_size + 3 * c.hidden_size * c.intermediate_size)
    itemsize = jnp.dtype(engine.resolved.kv_cache_dtype).itemsize
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(engine.runner.state))
    kv_bytes_per_token = c.num_layers * 2 * c.num_kv_heads * c.head_dim * itemsize

    groups = collections.defaultdict(list)
    for step, parts in zip(steps, per_step):
        groups[(step.kind, step.bucket)].append((step, parts))
    rows = []
    for (kind, bucket), members in sorted(groups.items()):
        wall = sum(s.wall_s for s, _ in members)
        parts = {p: sum(x[p] for _, x in members) for p in PARTS}
        row = dict(kind=kind, bucket=("T=" if kind == "prefill" else "S=") + str(bucket), steps=len(members),
                   seconds=round(wall, 3), ms_per_step=round(1e3 * statistics.mean(s.wall_s for s, _ in members), 2),
                   parts_s={p: round(v, 6) for p, v in parts.items()},
                   tokens=sum(s.tokens for s, _ in members))
        flops = sum(2 * c.num_layers * per_layer * s.tokens + 2 * c.vocab_size * c.hidden_size * s.seqs
                    + 4 * c.num_layers * c.num_heads * c.head_dim * s.attention_pairs for s, _ in members)
        row["gflops"] = round(flops / wall / 1e9, 1)
        row["matmul_gflops"] = round(sum(2 * c.num_layers * per_layer * s.tokens + 2 * c.vocab_size * c.hidden_size
                                         * s.seqs for s, _ in members) / max(parts["matmul"], 1e-9) / 1e9, 1)
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
        "",
        f"{'group':<15}{'steps':>6}{'s':>8}{'ms/step':>9}  {'parts of the time':<68}rate",
    ]
    for row in p["groups"]:
        if row["kind"] == "prefill":
            rate = f"{row['gflops']} GFLOP/s (matmuls alone {row['matmul_gflops']})"
        else:
            rate = f"{row['gbs']} GB/s (K/V in attention {row['kv_gbs_in_attention']})"
        lines.append(f"{row['kind'] + ' ' + row['bucket']:<15}{row['steps']:>6}{row['seconds']:>8.2f}"
                     f"{row['ms_per_step']:>9.1f}  {share(row['parts_s']):<68}{rate}")
    return "\n".join(lines)
