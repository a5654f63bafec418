"""vLLM's own names for the metrics we share with it, so a router that scrapes vLLM (the production-stack
router, the Gateway API Inference Extension, llm-d, KServe) reads a paged-jax replica unchanged.

metrics.py records each such value once more under every name here, beside its `paged_jax:` name: the
routers look for the `vllm:` names and nothing else, and a twin costs a few series. The names and
meanings follow vLLM's V1 PrometheusStatLogger (vllm/v1/metrics/loggers.py): its labels are
`model_name` and `engine` (the engine core's index, "0" for one), and where vLLM renamed a metric it
still exports the old name (`gpu_cache_usage_perc`, `gpu_prefix_cache_*`, `time_per_output_token_seconds`),
which older routers read, so both are here.
"""

PREFIX = "vllm:"
ENGINE = "0"  # vLLM's `engine` label: this server runs one engine

# Our name (without paged_jax:) -> vLLM's names for the same value. Counters drop `_total` here as
# prometheus_client adds it on the wire (vllm:prompt_tokens_total).
TWINS: dict[str, tuple[str, ...]] = {
    "num_requests_running": ("num_requests_running",),
    "num_requests_waiting": ("num_requests_waiting",),
    # The same fraction of blocks held by requests; GIE reads the new name, older routers the old.
    "kv_cache_usage_perc": ("kv_cache_usage_perc", "gpu_cache_usage_perc"),
    "num_preemptions": ("num_preemptions",),
    # In tokens, as vLLM counts them.
    "prefix_cache_queries": ("prefix_cache_queries", "gpu_prefix_cache_queries"),
    "prefix_cache_hits": ("prefix_cache_hits", "gpu_prefix_cache_hits"),
    "prompt_tokens": ("prompt_tokens",),
    "generation_tokens": ("generation_tokens",),
    "request_success": ("request_success",),
    "iteration_tokens_total": ("iteration_tokens_total",),
    "time_to_first_token_seconds": ("time_to_first_token_seconds",),
    # vLLM observes every gap between a request's outputs under both names (the second is the older).
    "inter_token_latency_seconds": ("inter_token_latency_seconds", "time_per_output_token_seconds"),
    "e2e_request_latency_seconds": ("e2e_request_latency_seconds",),
    "request_queue_time_seconds": ("request_queue_time_seconds",),
    "request_prompt_tokens": ("request_prompt_tokens",),
    "request_generation_tokens": ("request_generation_tokens",),
    "request_params_max_tokens": ("request_params_max_tokens",),
    "request_params_n": ("request_params_n",),
    "cache_config_info": ("cache_config_info",),
    "spec_decode_num_drafts": ("spec_decode_num_drafts",),
    "spec_decode_num_draft_tokens": ("spec_decode_num_draft_tokens",),
    "spec_decode_num_accepted_tokens": ("spec_decode_num_accepted_tokens",),
    "spec_decode_num_accepted_tokens_per_pos": ("spec_decode_num_accepted_tokens_per_pos",),
}

# vLLM's buckets where they differ from ours, so that histogram_quantile over a fleet of vLLM and
# paged-jax replicas adds like to like.
_REQUEST_LATENCY = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                    240.0, 480.0, 960.0, 1920.0, 7680.0)
_TOKEN_GAP = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
              80.0)
BUCKETS: dict[str, tuple[float, ...]] = {
    "time_to_first_token_seconds": (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                                    5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0),
    "inter_token_latency_seconds": _TOKEN_GAP,
    "time_per_output_token_seconds": _TOKEN_GAP,
    "e2e_request_latency_seconds": _REQUEST_LATENCY,
    "request_queue_time_seconds": _REQUEST_LATENCY,
}
