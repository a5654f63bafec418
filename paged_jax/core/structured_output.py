"""Constrained decoding with llguidance: compiling constraints off the engine thread, one matcher per
sequence, and each step's allowed tokens as a bitmask for the sampler.

A request's StructuredOutputsParams becomes a grammar (grammars.py) that `GrammarCompiler` compiles
with the model's tokenizer on a worker thread, once per distinct constraint (cached by its text), into
a matcher that every sequence of the request copies (`Guide`). Meanwhile the request waits at the
`GrammarGate`, outside the scheduler, so the engine loop goes on with the others.

A guide has consumed exactly its sequence's output tokens. Preemption keeps those tokens in both modes
(recompute computes the prompt and the output again, swap restores their KV), so the guide is kept as
it is; a fork (n > 1) copies its parent's. Each step `allowed_tokens` packs every sampling row's next
allowed tokens 32 to an int32 word, which the jitted sampler applies before any sampling mode.
Unconstrained rows get all ones, and a batch with no constraint the one cached all-ones array, so the
step's shapes never depend on whether a constraint is running. EOS is allowed only where the matcher
accepts; once the grammar admits nothing more the sequence ends with finish_reason "stop".
"""

import collections
import concurrent.futures
import logging
import threading
from collections.abc import Sequence
from typing import Protocol

import llguidance
import llguidance.hf
import llguidance.numpy
import numpy as np

from paged_jax.core import grammars
from paged_jax.core.sampling_tensors import all_allowed
from paged_jax.core.sampling_params import SamplingParams, StructuredOutputsParams

logger = logging.getLogger(__name__)

# Distinct constraints kept compiled; the oldest is dropped beyond this.
_CACHE_SIZE = 256
# How long a step with nothing else to run waits for a grammar to compile (so drivers do not spin).
_IDLE_WAIT_S = 0.01


class GrammarCompiler:
    """Compiles constraints for one model's tokenizer on one worker thread, each distinct one once."""

    def __init__(self, tokenizer, model_config):
        """tokenizer: a transformers fast tokenizer; model_config: the model's (its vocab_size, the width
        of its logits, and its eos_token_ids)."""
        self._tokenizer = tokenizer
        self._vocab_size = model_config.vocab_size
        self._eos_token_ids = list(model_config.eos_token_ids)
        self._ll_tokenizer = None  # built on the worker thread, on first use (about a second)
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="paged-jax-grammar")
        self._cache: collections.OrderedDict[str, concurrent.futures.Future] = collections.OrderedDict()
        self._lock = threading.Lock()  # submit is called from the engine thread and from request handlers

    def submit(self, so: StructuredOutputsParams) -> concurrent.futures.Future:
        """A future of the compiled matcher (an llguidance.LLMatcher to copy, never to advance), or of
        the GrammarError that says why the constraint cannot be compiled."""
        key = grammars.cache_key(so)
        with self._lock:
            future = self._cache.get(key)
            if future is None:
                future = self._cache[key] = self._executor.submit(self._compile, so)
                if len(self._cache) > _CACHE_SIZE:
                    self._cache.popitem(last=False)
            self._cache.move_to_end(key)
            return future

    def _compile(self, so: StructuredOutputsParams) -> llguidance.LLMatcher:
        if self._ll_tokenizer is None:
            self._ll_tokenizer = llguidance.hf.from_tokenizer(self._tokenizer, n_vocab=self._vocab_size,
                                                              eos_token=self._eos_token_ids)
        matcher = llguidance.LLMatcher(self._ll_tokenizer, grammars.grammar_text(so), log_level=0)
        if matcher.is_error():
            raise grammars.GrammarError(grammars.explain(so, matcher.get_error()))
        return matcher


class Guide:
    """One sequence's matcher, which has consumed exactly the sequence's output tokens."""

    __slots__ = ("matcher",)

    def __init__(self, matcher: llguidance.LLMatcher):
        self.matcher = matcher

    def fork(self) -> "Guide":
        return Guide(self.matcher.deep_copy())

    def accept(self, token: int) -> bool:
        """Advance past the sequence's new token; False, logged, if the grammar refuses it: the sampler
        drew from what the grammar allowed, so the matcher failed (hit one of llguidance's limits)."""
        if self.matcher.consume_token(token):
            return True
        logger.error("a constraint's matcher refused token %d: %s", token, self.matcher.get_error())
        return False

    @property
    def finished(self) -> bool:
        """Whether the grammar admits no more tokens (only EOS)."""
        return self.matcher.is_stopped()



def allowed_tokens(guides: Sequence[Guide | None], rows: int, vocab_size: int) -> np.ndarray:
    """int32 [rows, ceil(vocab_size / 32)]: bit j of word w of row i set where token 32 w + j may come
    next in row i. guides: one per row (None: unconstrained, every token allowed); rows past them are
    padding, all allowed. Read-only: without a guide it is the cached all-ones array."""
    ones = all_allowed(rows, vocab_size)
    if all(g is None for g in guides):
        return ones
    mask = ones.copy()
    # One row at a time: a row takes microseconds, less than handing rows to llguidance's thread pool
    # costs (measured on a CPU host whose cores the step's XLA threads share).
    for row, guide in enumerate(guides):
        if guide is not None:
            llguidance.numpy.fill_next_token_bitmask(guide.matcher, mask, row)
    return mask


# The gate names what it uses of a sequence and of the scheduler rather than import sequence.py and
# scheduler.py: a sequence holds a Guide from here, so those imports would close a circle.
class Seq(Protocol):
    """What the gate reads and sets of a sequence (sequence.Sequence is one)."""

    request_id: str
    params: SamplingParams
    guide: Guide | None

    @property
    def is_finished(self) -> bool: ...


class Queue(Protocol):
    """What the gate asks of the scheduler (scheduler.Scheduler is one)."""

    def add(self, seq: Seq) -> None: ...

    def finish(self, seq: Seq) -> None: ...

    def has_unfinished(self) -> bool: ...


class GrammarGate:
    """Where a new sequence enters the scheduler: at once without a constraint; with one, once its
    grammar has compiled (meanwhile it waits here, and the engine loop goes on with the others)."""

    def __init__(self, scheduler: Queue, tokenizer, model_config):
        """tokenizer, model_config: the model's (GrammarCompiler); without a tokenizer there is no
        compiler, and validation refuses constraints."""
        self.scheduler = scheduler
        self.compiler = None if tokenizer is None else GrammarCompiler(tokenizer, model_config)
        self._waiting: list[tuple[concurrent.futures.Future, Seq]] = []  # in arrival order

    def add(self, seq: Seq) -> None:
        if seq.params.structured_outputs is None:
            self.scheduler.add(seq)
        else:
            self._waiting.append((self.compiler.submit(seq.params.structured_outputs), seq))

    @property
    def request_ids(self) -> set[str]:
        """The requests waiting for their grammar."""
        return {seq.request_id for _, seq in self._waiting}

    @property
    def seqs(self) -> list[Seq]:
        """The sequences waiting for their grammar, in arrival order."""
        return [seq for _, seq in self._waiting]

    def admit(self) -> list[tuple[Seq, BaseException]]:
        """Queue the sequences whose grammar is ready, each with its guide; finish those whose grammar
        failed to compile and return them with the error, in arrival order. Aborted sequences are
        dropped. With nothing else to run, waits a moment for a compile, so that no driver spins."""
        self._waiting = [(f, s) for f, s in self._waiting if not s.is_finished]
        if self._waiting and not self.scheduler.has_unfinished():
            concurrent.futures.wait([f for f, _ in self._waiting], _IDLE_WAIT_S,
                                    return_when=concurrent.futures.FIRST_COMPLETED)
        failed, still = [], []
        for future, seq in self._waiting:
            if not future.done():
                still.append((future, seq))
            elif future.exception() is not None:
                self.scheduler.finish(seq)
                failed.append((seq, future.exception()))
            else:
                seq.guide = Guide(future.result().deep_copy())
                self.scheduler.add(seq)
        self._waiting = still
        return failed

    @staticmethod
    def refusal(seq: Seq, token: int) -> tuple[str, None] | None:
        """Advance seq's guide, if it has one, past its new token: ("error", None), the finish reason,
        if the guide refuses it (Guide.accept), else None."""
        return None if seq.guide is None or seq.guide.accept(token) else ("error", None)
