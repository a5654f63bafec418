"""The objects a process holds once an engine is warmed up, kept out of Python's cyclic garbage collector.

Building an engine and warming it up leave a few hundred thousand long-lived objects the collector
tracks (jax's, flax's and the tokenizer's modules, the model's graph, programs' wrappers). A step then
allocates freely (outputs, block names, the detokenizer's pieces), so the collector runs every few
hundred allocations, and every so often a full collection walks all of those objects again, on the
host's critical path: at 256 decoding sequences, 16 steps a dispatch, 5 to 7 ms of a dispatch's 25
(bench_overlap.py's stand-in on a loaded 2-core Xeon, timed by gc.callbacks). vLLM freezes its
engine's startup heap the same way (gc.freeze).

`freeze` moves every object alive into the collector's permanent generation, which it never walks.
It first unfreezes and collects, so what an earlier freeze kept (an engine warmed up before this one
and dropped since, if it was part of a reference cycle) is freed rather than kept for the process's
life. That full collection costs a few tenths of a second, so warm-up does it (warmup.py: a server
warms up, and so does an offline job that wants even steps), not every engine's construction.
"""

import gc


def freeze() -> None:
    """Collect the process's garbage, then put every object still alive out of the collector's walks."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()
