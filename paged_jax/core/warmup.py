"""Warm-up: every program an engine step can run, made before the first request, so that nothing
compiles once a server says it is ready.

buckets.py lists the shapes (a few dozen, from the engine's limits); the runner runs each once on
padding that writes no KV (model_runner.ModelRunner.warm_up), and the block manager makes its pool
calls' programs. Each program is compiled, or loaded from the persistent compilation cache when an
earlier run made it: a cold start compiles, a warm one loads. The model call's and the sampler's
programs are compiled side by side first, one per core (parallel_compile.py). Last, the process's
heap is frozen out of the garbage collector's walks (startup_heap.py).

A server warms up before it reports ready (serving/async_engine.py). The offline `LLM` does not: a
batch job compiles the shapes it meets as it meets them, which is never more than warming up all of
them, and a small job meets few; `warm_up(llm.engine)` is there for a job that wants even steps.
"""

import dataclasses
import logging
import time

from paged_jax.core import compiles, startup_heap

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class WarmUp:
    num_step_shapes: int  # shapes of the model call
    num_sampler_shapes: int  # row counts of the head and sampler, each with and without penalties, greedy or not
    num_programs: int  # programs compiled or loaded from the persistent cache during the warm-up
    seconds: float


def warm_up(engine) -> WarmUp:
    """Make every program `engine` (an LLMEngine) can run in a step; log and return what it took."""
    start, before, buckets = time.perf_counter(), compiles.count(), engine.resolved.buckets
    engine.runner.warm_up()
    engine.blocks.warm_up()
    startup_heap.freeze()
    done = WarmUp(len(buckets.shapes()), 4 * len(buckets.all_sample_rows()), compiles.count() - before,
                  time.perf_counter() - start)
    logger.info("warm-up: %d step shapes and %d sampler shapes; %d programs compiled or loaded from the "
                "persistent cache in %.1f s", done.num_step_shapes, done.num_sampler_shapes, done.num_programs,
                done.seconds)
    return done
