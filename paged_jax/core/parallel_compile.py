"""Compiling a warm-up's programs side by side.

A warm-up makes every program a step can run (warmup.py), and XLA compiles each of them on one
thread for most of its passes: 13 model-call shapes and 48 sampler programs for SmolLM2 on the CPU,
and on an H100 each model-call program took about 20 s (docs/gpu.md), a quarter of an hour for a
server to become ready. Lowering is Python and stays on the caller's thread; `Lowered.compile` is
XLA's own C++ work and runs with the GIL released, so several compile at once, one per core. Each
compiled program lands in jit's caches (and the persistent compilation cache), so the warm-up's
calls after find them made.
"""

import os
from concurrent.futures import ThreadPoolExecutor

import jax


def workers() -> int:
    """Programs compiled at once: one per core this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def compile_all(lowered: list[jax.stages.Lowered]) -> list[jax.stages.Compiled]:
    """Each lowered program compiled, up to workers() at a time; raises the first compile's error."""
    if len(lowered) < 2 or workers() < 2:
        return [program.compile() for program in lowered]
    with ThreadPoolExecutor(workers()) as pool:
        return list(pool.map(lambda program: program.compile(), lowered))
