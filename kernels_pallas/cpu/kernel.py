"""The CPU kernels, built on first use and called through XLA's FFI: paged attention
(attention.cc), the matmul over weights packed in column panels (linear.cc), and its int8 form
(linear_int8.cc: int8 weights with per-column scales, activations quantized per row as it runs), and
a few-row step's LoRA delta by each row's own slot (lora.cc); and, in a library of its own built where
the oneDNN wheels are installed, oneDNN's matmul for prefill-sized row counts (onednn_linear.cc).

This module is their one door; each idea has a module of its own: library.py builds, loads and
switches the libraries (where no compiler works, `available()` is False, `build_error()` says why,
and the engine stays on the pure-XLA paths: cpu/xla.py, XLA's dot), attention.py calls the attention
kernels, packing.py lays the weights out once at load, and linear.py calls the matmuls.
"""

from kernels_pallas.cpu.attention import PAGE_DTYPES, layout_attributes, paged_attention_cpu, write_kv_cpu
from kernels_pallas.cpu.library import (amx_usable, available, build_error, onednn_available, onednn_error,
                                        prepare_onednn, unwritten, use_amx, use_helpers)
from kernels_pallas.cpu.linear import argmax_linear_cpu, linear_cpu, linear_int8_cpu, linear_onednn_cpu, lora_cpu, onednn_min_rows
from kernels_pallas.cpu.packing import (INT8_GROUP, ONEDNN_DEPTH, ONEDNN_PANEL, PANEL, pack_columns, pack_int8,
                                        pack_panels, unpack_columns, unpack_int8)

__all__ = [
    "INT8_GROUP", "ONEDNN_DEPTH", "ONEDNN_PANEL", "PAGE_DTYPES", "PANEL",
    "amx_usable", "argmax_linear_cpu", "available", "build_error", "layout_attributes", "linear_cpu", "linear_int8_cpu",
    "linear_onednn_cpu", "lora_cpu", "onednn_available", "onednn_error", "onednn_min_rows",
    "pack_columns", "pack_int8", "pack_panels", "paged_attention_cpu", "prepare_onednn", "unpack_columns", "unpack_int8",
    "unwritten", "use_amx", "use_helpers", "write_kv_cpu",
]
