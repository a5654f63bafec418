"""What this machine can do at best, measured in this process: the matmul rate and the memory read rate
that the step profile (step_profile.py) rates engine steps against."""

import time

import jax
import jax.numpy as jnp


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
