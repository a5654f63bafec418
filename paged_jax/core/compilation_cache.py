"""The persistent compilation cache: compiled programs kept on disk, so a second run starts without
compiling. The cache is the process's, so it is set once, before anything compiles (as JAX advises),
when the engine is imported, never as a side effect of constructing an engine."""

import jax

from models.loader import cache_dir


def enable() -> None:
    """Keep compiled programs on disk, so a second run starts without compiling (unless the user
    chose a cache of their own). Every program: JAX keeps only those that took a second or more to
    compile by default, but the block pool's small ones add up to about half a second a start, and
    loading one takes milliseconds."""
    if jax.config.jax_compilation_cache_dir is None:
        jax.config.update("jax_compilation_cache_dir", str(cache_dir() / "xla"))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
