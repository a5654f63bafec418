"""XLA programs made in this process, counted as JAX makes them.

Every program a jitted call (or an eager op) needs the first time it meets a shape is either compiled
or loaded from the persistent compilation cache; either way the calling thread stalls, seconds for a
step and never less than a few milliseconds. JAX reports each one as a backend-compile event: counting
those counts every program, whichever function asked for it (the step, the sampler, the block pool's
calls, a stray eager op), so "nothing compiles once the server is ready" is a check on this count.

The count is process-wide, as jit's caches are: two engines in one process share their programs.
"""

import threading

import jax

# jax._src.dispatch.BACKEND_COMPILE_EVENT: around compile_or_get_cached, so a load from the
# persistent cache counts too (tests/core/test_warmup.py checks that the event still fires).
_EVENT = "/jax/core/compile/backend_compile_duration"

_lock = threading.Lock()
_count = 0
_seconds = 0.0


def _listen(event: str, duration: float, **_) -> None:
    global _count, _seconds
    if event == _EVENT:
        with _lock:
            _count += 1
            _seconds += duration


jax.monitoring.register_event_duration_secs_listener(_listen)


def count() -> int:
    """Programs compiled or loaded from the persistent cache so far in this process."""
    return _count


def seconds() -> float:
    """Time spent compiling or loading them (s)."""
    return _seconds
