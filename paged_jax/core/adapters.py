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
    def __init__(self, model_config: ModelConfig, max_loras: int, max_rank: int, max_cpu_loras: int, dtype):
        """dtype: the model's parameters' (the adapters run in it)."""
        if max_cpu_loras < max_loras:
            raise ValueError(f"max_cpu_loras ({max_cpu_loras}) must be at least max_loras ({max_loras})")
        self.model_config, self.max_rank, self.max_cpu_loras, self.dtype = model_config, max_rank, max_cpu_loras, dtype
        # Committed to the device, as load_into's outputs are: the step compiles once for both.
        self.weights = jax.tree.map(lambda x: jax.device_put(x, x.sharding),
                                    lora.empty(model_config, max_loras, max_rank, dtype))
        self.held: list[int | None] = [None] * max_loras  # the adapter id in slot s + 1
        self._loads = collections.Counter()  # slot -> when it was last loaded (a load count)
        self._host: collections.OrderedDict[int, lora.LoRAWeights] = collections.OrderedDict()
        self.num_loads = 0

    def check(self, request: LoRARequest) -> None:
        """Read request's adapter now if it is not held on the host, so that a bad one is refused when it is
        asked for (RequestError naming lora_request), never in a step."""
        if request.lora_int_id in self._host:
            self._host.move_to_end(request.lora_int_id)
            return
        try:
            adapter = peft_adapter.read(request.lora_path, self.model_config)
        except (OSError, ValueError) as error:
            raise RequestError(f"LoRA adapter {request.lora_name!r}: {error}", "lora_request") from error
        if adapter.rank > self.max_rank:
            raise RequestError(f"LoRA adapter {request.lora_name!r} has rank {adapter.rank}, above max_lora_rank "
                               f"{self.max_rank}", "lora_request")
        self._host[request.lora_int_id] = lora.host_slot(self.model_config, self.max_rank, self.dtype,
                                                         adapter.modules, adapter.scale)
        while len(self._host) > self.max_cpu_loras:
            self._host.popitem(last=False)

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
        zeros = lora.host_slot(self.model_config, self.max_rank, self.dtype, {}, 1.0)
        self.weights = lora.load_into(self.weights, np.int32(1), zeros)
        self.held[0] = None


def with_row_slots(step_input, scheduled):
    """step_input (batch.StepInput) with lora_slots: int32 [num_tokens], each row its sequence's slot, 0 for
    padding and for sequences without an adapter."""
    slots = np.zeros(step_input.input_ids.shape[0], np.int32)
    counts = [s.num_new_tokens for s in scheduled]
    slots[: sum(counts)] = np.repeat(np.fromiter((s.seq.lora_slot for s in scheduled), np.int32, len(counts)), counts)
    return dataclasses.replace(step_input, lora_slots=slots)
