"""Seconds per XLA op in each engine step, read from a JAX profiler trace (jax.profiler.start_trace).

Each engine step is a trace annotation "engine_step_<i>" on the Python thread; XLA's ops are events
on the other threads, nested (a loop holds its body's ops). Each instant of a step goes to the
innermost op running then on each thread, shared evenly where threads run ops at once, and to the
host ("") where none runs: so a step's seconds add up to its wall time.
"""

import collections
from pathlib import Path


def op_seconds_per_step(folder: str, num_steps: int) -> list[dict[tuple[str, str], float]]:
    """Per engine step, seconds keyed by (HLO module, op name), "" for host time: each thread's
    innermost op at each instant, time shared evenly by the ops running at once."""
    from jax.profiler import ProfileData

    path = next(Path(folder).rglob("*.xplane.pb"))
    plane = ProfileData.from_file(str(path)).find_plane_with_name("/host:CPU")
    windows = [None] * num_steps
    threads = []
    for line in plane.lines:
        if line.name == "python":
            for e in line.events:
                if e.name.startswith("engine_step_"):
                    windows[int(e.name[len("engine_step_"):])] = (e.start_ns, e.end_ns)
        else:
            ops = []
            for e in line.events:
                stats = dict(e.stats)
                if "hlo_op" in stats:
                    ops.append((e.start_ns, e.end_ns, (stats.get("hlo_module", ""), stats["hlo_op"])))
            threads.append(ops)
    segments = sorted(s for ops in threads for s in _innermost(ops))
    out = []
    cursor = 0
    for start, end in windows:
        while cursor < len(segments) and segments[cursor][1] <= start:
            cursor += 1
        inside = []
        for s in segments[cursor:]:
            if s[0] >= end:
                break
            inside.append((max(s[0], start), min(s[1], end), s[2]))
        out.append(_share(inside, start, end))
    return out


def _innermost(ops: list[tuple[int, int, tuple]]) -> list[tuple[int, int, tuple]]:
    """One thread's op events (nested: a loop holds its body's ops) as non-overlapping segments,
    each instant given to the innermost op running then."""
    out, stack, t = [], [], 0
    for start, end, key in sorted(ops, key=lambda e: (e[0], -e[1])):
        while stack and stack[-1][0] <= start:
            done, owner = stack.pop()
            out.append((t, done, owner))
            t = done
        if stack:
            out.append((t, start, stack[-1][1]))
            end = min(end, stack[-1][0])
        stack.append((end, key))
        t = start
    while stack:
        done, owner = stack.pop()
        out.append((t, done, owner))
        t = done
    return [s for s in out if s[1] > s[0]]


def _share(segments, start: int, end: int) -> dict[tuple[str, str], float]:
    """Seconds per op over [start, end]: each instant split evenly among the ops running; "" none."""
    edges = sorted({start, end, *(s[0] for s in segments), *(s[1] for s in segments)})
    events = collections.defaultdict(list)
    for s in segments:
        events[s[0]].append((1, s[2]))
        events[s[1]].append((-1, s[2]))
    active: collections.Counter = collections.Counter()
    seconds: dict = collections.defaultdict(float)
    for a, b in zip(edges, edges[1:]):
        for sign, key in events.get(a, ()):
            active[key] += sign
            if active[key] == 0:
                del active[key]
        n = sum(active.values())
        if n == 0:
            seconds[("", "")] += (b - a) / 1e9
        for key, count in active.items():
            seconds[key] += (b - a) / 1e9 * count / n
    return seconds
