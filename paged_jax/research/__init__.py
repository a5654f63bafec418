"""Instruments built on the engine's parts, never used by it: the functional page table and batching
simulator (page_table.py, simulate.py), replay of a workload through the real scheduler (replay.py),
and the step profile from a JAX trace (step_profile.py, with hlo_parts.py, trace_ops.py and
machine_peaks.py)."""
