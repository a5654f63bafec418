"""Scheduling policies: the order in which the scheduler serves sequences, and so which one gives way.

A policy is one sort key over sequences, lowest first. Under a keyed policy the scheduler keeps both
its queues sorted by the key, stably, so ties keep the order events gave them (arrival, a fork right
behind its parent, a preempted sequence back at the head of its equals). The waiting sequence with the
lowest key is admitted first and the running sequence with the highest key is preempted first.

- "fcfs" has no key: the queues keep the order of events, exactly as before policies existed. The
  newest admitted gives way first; the queue's head is never overtaken, so nothing starves.
- "priority" (vLLM's): key (priority, arrival time). A lower value runs first and the lowest priority
  (highest value), latest arrival among equals, is preempted first. A steady stream of urgent requests
  starves the others, by design, as in vLLM.
- "shortest_prompt_first": key (prompt length, arrival time), which lowers mean time to first token
  when prompts differ widely. It can starve: a long prompt waits as long as shorter ones keep arriving
  (there is no aging), and the longest running prompt is preempted first.
"""

from collections.abc import Callable

from paged_jax.core.errors import RequestError
from paged_jax.core.sequence import Sequence

POLICIES = ("fcfs", "priority", "shortest_prompt_first")

SortKey = Callable[[Sequence], tuple]

_KEYS: dict[str, SortKey | None] = {
    "fcfs": None,
    "priority": lambda seq: (seq.priority, seq.arrival_time),
    "shortest_prompt_first": lambda seq: (seq.num_prompt_tokens, seq.arrival_time),
}


def sort_key(policy: str) -> SortKey | None:
    """The policy's key over sequences (lowest served first), None for FCFS's order of events."""
    if policy not in _KEYS:
        raise ValueError(f"scheduling_policy must be one of {POLICIES}, got {policy!r}")
    return _KEYS[policy]


def check_priority(policy: str, priority: int) -> None:
    """Refuse a priority the policy would ignore (any but 0 outside "priority"), as vLLM does."""
    if priority != 0 and policy != "priority":
        raise RequestError(f"priority {priority} given, but scheduling_policy is {policy!r}, not 'priority'",
                           "priority")
