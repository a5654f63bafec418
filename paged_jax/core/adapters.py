"""The engine's LoRA adapters: which adapter each device slot holds (models/lora.py), the host copies of
the most recently used ones, and each row's slot in a step's flat batch.

An adapter is read from its folder when a request first names it, and its host copy is kept among the
last max_cpu_loras used (least recently used dropped, read again if named again). A sequence runs once
its adapter is in a slot: at admission it takes the slot holding it, or loads it into a slot no running
sequence uses (least recently loaded first); when every slot is in use the sequence waits in the queue.
A load is one call of a program compiled at warm-up (lora.load_into), so adapters come and go without a
compile.
"""

import collections
import dataclasses

import jax
import numpy as np

from models import lora, peft_adapter
from models.config import ModelConfig
from paged_jax.core.errors import RequestError
from paged_jax.core.lora_request import LoRARequest


class AdapterSlots:
    def __init__(self, model_config: ModelConfig, max_loras: int, max_rank: int, max_cpu_loras: int, dtype,
                 packed: bool = False):
        """dtype: the model's parameters' (the adapters run in it); packed: the model's matmuls are the C++
        kernel's over packed weights, and the adapters' are too where lora.packable (models/lora_packed.py)."""
        if max_cpu_loras < max_loras:
            raise ValueError(f"max_cpu_loras ({max_cpu_loras}) must be at least max_loras ({max_loras})")
        self.model_config, self.max_rank, self.max_cpu_loras, self.dtype = model_config, max_rank, max_cpu_loras, dtype
        # Committed to the device, as load_into's outputs are: the step compiles once for both.
        self.weights = jax.tree.map(lambda x: jax.device_put(x, x.sharding),
                                    lora.empty(model_config, max_loras, max_rank, dtype,
                                               packed and lora.packable(model_config, dtype)))
        self.max_loras = max_loras
        self.held: list[int | None] = [None] * max_loras  # the adapter id in slot s + 1
        self._loads = collections.Counter()  # slot -> when it was last loaded (a load count)
        self._host: collections.OrderedDict[int, lora.HostAdapter] = collections.OrderedDict()
        self.num_loads = 0

    def check(self, request: LoRARequest) -> None:
        """Read request's adapter now if it is not held on the host, so that a bad one is refused when it is
        asked for (RequestError naming lora_request), never in a step."""
        if request.lora_int_id in self._host:
            self._host.move_to_end(request.lora_int_id)
            return
        self.keep(request.lora_int_id, self.read(request))

    def read(self, request: LoRARequest) -> lora.HostAdapter:
        """request's adapter from its folder as one slot's host arrays (lora.host_slot), or RequestError.
        Reads nothing of this object's state that changes: a server calls it off the engine's thread."""
        try:
            adapter = peft_adapter.read(request.lora_path, self.model_config)
        except (OSError, ValueError) as error:
            raise RequestError(f"LoRA adapter {request.lora_name!r}: {error}", "lora_request") from error
        if adapter.rank > self.max_rank:
            raise RequestError(f"LoRA adapter {request.lora_name!r} has rank {adapter.rank}, above max_lora_rank "
                               f"{self.max_rank}", "lora_request")
        return lora.host_slot(self.model_config, self.max_rank, adapter.modules, adapter.scale)

    def keep(self, lora_int_id: int, weights: lora.HostAdapter) -> None:
        """Hold an adapter's host arrays (read's) as the most recently used, dropping the least beyond
        max_cpu_loras."""
        self._host[lora_int_id] = weights
        self._host.move_to_end(lora_int_id)
        while len(self._host) > self.max_cpu_loras:
            self._host.popitem(last=False)

    def remove(self, lora_int_id: int) -> None:
        """Forget an adapter (a server's unload): its host copy goes, and its slot, if it has one, is free
        and the next to be loaded. The caller makes sure no sequence runs with it."""
        self._host.pop(lora_int_id, None)
        if lora_int_id in self.held:
            slot = self.held.index(lora_int_id) + 1
            self.held[slot - 1] = None
            self._loads[slot] = 0

    def acquire(self, request: LoRARequest, running) -> int:
        """The slot (>= 1) holding request's adapter for a sequence about to run, loaded now if none does;
        0 if every slot is in use by one of `running` (Sequences, each with its lora_slot)."""
        key = request.lora_int_id
        if key in self.held:
            return self.held.index(key) + 1
        in_use = {s.lora_slot for s in running}
        free = [s for s in range(1, len(self.held) + 1) if s not in in_use]
        if not free:
            return 0
        slot = min(free, key=lambda s: self._loads[s])
        self.check(request)  # read again if the host copy was dropped
        self.weights = lora.load_into(self.weights, np.int32(slot), self._host[key])
        self.held[slot - 1] = key
        self.num_loads += 1
        self._loads[slot] = self.num_loads
        return slot

    def warm_up(self) -> None:
        """Compile the load (an empty adapter into slot 1, which changes nothing)."""
        zeros = lora.host_slot(self.model_config, self.max_rank, {}, 1.0)
        self.weights = lora.load_into(self.weights, np.int32(1), zeros)
        self.held[0] = None


# Steps of this many tokens and more whose rows use one adapter (prefill, mostly) run the delta over its
# slot alone (lora.LoRARows): over every slot, the delta's work is max_loras times one adapter's, 26% of a
# 512-token SmolLM2 prefill with 4 slots against 7% (scripts/bench_lora.py). Each such step shape then has
# a second program, for steps that mix adapters; below, one program over every slot serves all (decode:
# the step reads every slot's weights once whatever it does).
ONE_SLOT_MIN_TOKENS = 128


def with_lora_rows(step_input, scheduled, max_loras: int, *, every_slot: bool = False):
    """step_input (batch.StepInput) with its lora_rows: each row on its sequence's slot (Sequence.lora_slot;
    padding and sequences without an adapter: none), over one slot where the step allows (unless every_slot)."""
    num_tokens = step_input.input_ids.shape[0]
    row_slots = np.zeros(num_tokens, np.int32)
    counts = [s.num_new_tokens for s in scheduled]
    row_slots[: sum(counts)] = np.repeat(np.fromiter((s.seq.lora_slot for s in scheduled), np.int32, len(counts)),
                                         counts)
    used = {s.seq.lora_slot for s in scheduled} - {0}
    if num_tokens >= ONE_SLOT_MIN_TOKENS and len(used) <= 1 and not every_slot:
        slot = used.pop() if used else 0
        rows = lora.LoRARows(np.asarray([slot], np.int32), np.where(row_slots > 0, 0, -1).astype(np.int32))
    else:
        rows = lora.LoRARows(np.arange(1, max_loras + 1, dtype=np.int32), row_slots - 1)
    return dataclasses.replace(step_input, lora_rows=rows)


def padding_forms(step_input, max_loras: int) -> list:
    """A padding step_input in each form of lora_rows a step of its shape can take, for the warm-up."""
    forms = [with_lora_rows(step_input, [], max_loras, every_slot=True)]
    if step_input.input_ids.shape[0] >= ONE_SLOT_MIN_TOKENS:
        forms.append(with_lora_rows(step_input, [], max_loras))
    return forms
