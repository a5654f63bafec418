"""Which of a step's layer matmuls go through oneDNN on the CPU, decided once, when the engine is built."""

import logging

from kernels_pallas.cpu import kernel as cpu_kernel

logger = logging.getLogger(__name__)


def onednn_rows(config, model_config, token_buckets: list[int]) -> int:
    """The fewest tokens from which a step's layer matmuls go through oneDNN (0: never), measured here
    against the C++ matmul over the step sizes the engine can meet (kernel.onednn_min_rows).

    config: the EngineConfig; model_config: the model's ModelConfig; token_buckets: the step sizes
    (buckets.StepBuckets.token_buckets), ascending."""
    if config.quantization is not None or not cpu_kernel.onednn_available():
        logger.info("oneDNN matmul: not used (%s)", cpu_kernel.onednn_error() or "quantized weights")
        return 0
    c = model_config
    shapes = ((c.hidden_size, (c.num_heads + 2 * c.num_kv_heads) * c.head_dim),
              (c.num_heads * c.head_dim, c.hidden_size), (c.hidden_size, 2 * c.intermediate_size),
              (c.intermediate_size, c.hidden_size))
    # Below 64 rows the C++ matmul, made for decode's few rows, has always been the faster.
    rows = cpu_kernel.onednn_min_rows(shapes, tuple(t for t in token_buckets if t >= 64))
    logger.info("oneDNN matmul: %s", f"steps of {rows} tokens and more" if rows else "slower here at every size")
    if rows:  # its primitives' code generated now, not in the middle of traffic
        cpu_kernel.prepare_onednn(shapes, token_buckets[-1])
    return rows
