"""A warmed-up engine's heap is out of the garbage collector's walks (startup_heap.py), and the next
warm-up frees what an earlier one kept and was dropped since."""

import gc
import weakref

import pytest

from models import load_model
from paged_jax import EngineConfig, LLMEngine
from paged_jax.core import warmup


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint):
    return load_model(tiny_checkpoint("smollm2")[0])


class _Cycle:
    """An object in a reference cycle: only the cyclic collector frees it."""

    def __init__(self):
        self.me = self


def make_engine(tiny) -> LLMEngine:
    return LLMEngine(tiny.model, tiny.config, tiny.tokenizer,
                     EngineConfig(block_size=8, num_blocks=40, max_num_seqs=4, max_num_batched_tokens=32))


def test_warming_up_freezes_the_heap_and_frees_what_an_earlier_warm_up_kept(tiny):
    gc.unfreeze()
    kept = _Cycle()
    engine = make_engine(tiny)
    warmup.warm_up(engine)
    assert gc.get_freeze_count() > 10_000  # the modules, the model, the engine
    assert not gc.is_tracked(kept) or all(kept is not o for o in gc.get_objects())  # frozen: not walked
    dropped = weakref.ref(kept)
    del kept
    gc.collect()
    assert dropped() is not None  # a frozen cycle outlives a collection
    warmup.warm_up(engine)
    assert dropped() is None  # the next freeze collected it first
