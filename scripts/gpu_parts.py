"""What scripts/gpu_check.py and scripts/bench_gpu.py share: a part's Result, how a part is run and
printed (an exception fails that part alone), and the measurements both take: a compiled call's time,
a device copy's bandwidth, and one layer of SmolLM2's bfloat16 decode batch from the kernel test matrix.
"""

import dataclasses
import pathlib
import sys
import time
import traceback
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

# The kernel's case matrix belongs to the test suite; the GPU scripts run the same matrix compiled.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests" / "kernels"))
import kernel_matrix as kernel_testing  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Result:
    name: str
    ok: bool
    figures: dict
    skipped: bool = False  # the part could not run here (figures["why"] says why); ok stays True

    @property
    def verdict(self) -> str:
        return "SKIP" if self.skipped else "PASS" if self.ok else "FAIL"


class Skip(Exception):
    """A part that cannot run here; the message says why."""


def record(name: str, part: Callable[[], list[Result]]) -> list[Result]:
    """part()'s results, each printed as `[VERDICT] name: figures`, then the part's time. An exception
    fails the part (traceback printed), a Skip skips it: the next part runs either way, since on new
    hardware every part's verdict is worth having."""
    start = time.perf_counter()
    try:
        results = part()
    except Skip as why:
        results = [Result(name, True, {"why": str(why)}, skipped=True)]
    except Exception as e:
        traceback.print_exc()
        results = [Result(name, False, {"error": f"{type(e).__name__}: {str(e)[:300]}"})]
    for r in results:
        print(f"[{r.verdict}] {r.name}: " + ", ".join(f"{k} {v}" for k, v in r.figures.items()), flush=True)
    print(f"      ({name}: {time.perf_counter() - start:.1f} s, compiles included)", flush=True)
    return results


def figure(x: float) -> float:
    """Three significant digits: a rate from the interpreter is far below 0.1 GB/s, and must not round to 0."""
    return float(f"{x:.3g}")


def on_device(platform: str) -> jax.Device:
    """The device the checked path runs on; a RuntimeError when JAX sees none of that platform."""
    return jax.devices(platform)[0]


def timed(f, *args, repeats: int) -> float:
    """Median seconds of f(*args) once compiled."""
    jax.block_until_ready(f(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def copy_bandwidth(num_bytes: int, repeats: int) -> float:
    """Bytes/s of reading and writing an array of num_bytes on the default device."""
    x = jnp.ones(num_bytes // 4, jnp.float32)
    return 2 * num_bytes / timed(jax.jit(lambda a: a + 1), x, repeats=repeats)


def smollm2_decode_case(num_seqs: int, context: int) -> kernel_testing.Case:
    """One layer of a bfloat16 decode batch of SmolLM2's shapes: num_seqs sequences of context tokens."""
    return kernel_testing.Case(q_lens=(1,) * num_seqs, seq_lens=(context,) * num_seqs, num_heads=9, num_kv_heads=3,
                               head_dim=64, block_size=16, dtype=jnp.bfloat16)


def kv_bytes(case: kernel_testing.Case) -> int:
    """The K/V bytes one layer of a decode `case` reads: every sequence's keys and values, once."""
    return 2 * sum(case.seq_lens) * case.num_kv_heads * case.head_dim * jnp.dtype(case.dtype).itemsize
