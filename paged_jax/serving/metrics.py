"""Prometheus metrics of a serving engine: vLLM's names under the prefix `paged_jax:`, and again under
vLLM's own `vllm:` names (vllm_metrics.py) for every metric vLLM has, so a router or dashboard built
for vLLM reads a replica unchanged; metrics vLLM lacks (rejections, timeouts, compiles, step time and
its host and device parts, KV blocks by state, the attention backend) take names in the same style.

Everything carries a `model_name` label, as vLLM's do (the `vllm:` twins also vLLM's `engine`).
Recording happens on the engine loop's thread (`record`, a StatLogger) and on the server's (`reject`);
prometheus_client's collectors are thread-safe.
"""

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics

from paged_jax.serving import vllm_metrics
from paged_jax.serving.async_engine import StatLogger
from paged_jax.serving.stats import IterationStats, SchedulerStats

PREFIX = "paged_jax:"
FINISH_REASONS = ("stop", "length", "abort", "timeout", "queue_timeout", "error")
REJECT_CAUSES = ("queue_full", "too_long", "bad_params", "unauthorized", "not_found", "body_too_large",
                 "slo_admission", "circuit_open")

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                    10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
# The parts of a step: a host's share is a few milliseconds.
_STEP_PART_BUCKETS = (0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.06, 0.08, 0.1,
                      0.25, 0.5, 1.0, 2.5, 5.0)
_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                    240.0, 480.0, 960.0, 1920.0)


def _1_2_5_buckets(limit: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to limit (vLLM's buckets for token counts)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > limit:
                return out
            out.append(m * scale)
        scale *= 10


class _Children:
    """One value recorded in several series at once: ours and its vLLM twins."""

    def __init__(self, children: list):
        self._children = children

    def inc(self, amount: float = 1.0) -> None:
        for child in self._children:
            child.inc(amount)

    def set(self, value: float) -> None:
        for child in self._children:
            child.set(value)

    def observe(self, value: float) -> None:
        for child in self._children:
            child.observe(value)


class _Metrics:
    """A metric under several names, each with the labels all its series carry: labels() picks the
    series of the remaining labels in every one."""

    def __init__(self, named: list[tuple[object, dict[str, str]]]):
        self._named = named

    def labels(self, **more: str) -> _Children:
        return _Children([metric.labels(**labels, **more) for metric, labels in self._named])


class PrometheusMetrics(StatLogger):
    def __init__(self, registry: CollectorRegistry, model_name: str, *, max_model_len: int,
                 cache_config: dict[str, str], attention_backend: str, max_loras: int | None = None):
        """cache_config: labels for the info metric (block size, block count, ...). max_loras: with LoRA
        enabled, the adapters a step may mix (vLLM's lora_requests_info is exported then)."""
        # A "_created" twin of every counter and histogram is clutter nobody reads (vLLM drops them too).
        disable_created_metrics()
        labels = {"model_name": model_name}
        self._previous: SchedulerStats | None = None

        def make(kind, name, doc, labelnames=(), **kwargs):
            named = [(kind(PREFIX + name, doc, ["model_name", *labelnames], registry=registry, **kwargs), labels)]
            for twin in vllm_metrics.TWINS.get(name, ()):
                twin_kwargs = kwargs | ({"buckets": vllm_metrics.BUCKETS[twin]} if twin in vllm_metrics.BUCKETS else {})
                named.append((kind(vllm_metrics.PREFIX + twin, doc, ["model_name", "engine", *labelnames],
                                   registry=registry, **twin_kwargs), labels | {"engine": vllm_metrics.ENGINE}))
            metric = _Metrics(named)
            return metric if labelnames else metric.labels()

        def by_label(metric_kind, name, doc, label, values, **kwargs):
            metric = make(metric_kind, name, doc, (label,), **kwargs)
            return {v: metric.labels(**{label: v}) for v in values}

        # The engine's state.
        self.running = make(Gauge, "num_requests_running", "Requests the scheduler runs (admitted, not finished).")
        self.waiting = make(Gauge, "num_requests_waiting", "Requests accepted and waiting for admission.")
        self.kv_usage = make(Gauge, "kv_cache_usage_perc",
                             "Fraction of KV-cache blocks held by requests (0 to 1); prefix-cached blocks no "
                             "request holds count as free.")
        self.kv_blocks = by_label(Gauge, "num_kv_cache_blocks",
                                  "KV-cache blocks by state: used by requests, cached (held by the prefix cache "
                                  "alone, reusable), free.", "state", ("used", "cached", "free"))
        self.preemptions = make(Counter, "num_preemptions", "Preemptions of running sequences.")
        self.prefix_queries = make(Counter, "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = make(Counter, "prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.compiles = make(Counter, "num_compiles", "XLA programs compiled or loaded from the persistent cache in "
                             "this process (after warm-up: none).")
        # Speculative decoding, vLLM's names: drafts verified (one a sequence and step), their
        # tokens, those accepted, and those accepted at each draft position (0: the first draft).
        spec = {name: make(Counter, name, doc) for name, doc in (
            ("spec_decode_num_drafts", "Drafts verified (one per sequence and step with drafts)."),
            ("spec_decode_num_draft_tokens", "Draft tokens verified."),
            ("spec_decode_num_accepted_tokens", "Draft tokens accepted."))}
        self.spec_per_position = make(Counter, "spec_decode_num_accepted_tokens_per_pos",
                                      "Draft tokens accepted at each position of their drafts.", ("position",))
        # The engine keeps these as running totals; the counters take the increments.
        self._engine_counters = ((self.preemptions, "num_preemptions"), (self.prefix_queries, "prefix_cache_queries"),
                                 (self.prefix_hits, "prefix_cache_hits"), (self.compiles, "num_compiles"),
                                 *((counter, name) for name, counter in spec.items()))
        self.prompt_tokens = make(Counter, "prompt_tokens", "Prompt tokens of requests that produced a first token.")
        self.generation_tokens = make(Counter, "generation_tokens", "Generated tokens.")
        self.step_time = make(Histogram, "engine_step_time_seconds", "Wall time of one engine step.",
                              buckets=_LATENCY_BUCKETS)
        self.step_device_time = make(Histogram, "engine_step_device_seconds",
                                     "Time one engine step waits for the device: from its first call until its "
                                     "samples are on the host.", buckets=_STEP_PART_BUCKETS)
        self.step_host_time = make(Histogram, "engine_step_host_seconds",
                                   "The host's own time in one engine step: scheduling, building the batch, "
                                   "building the outputs.", buckets=_STEP_PART_BUCKETS)
        self.iteration_tokens = make(Histogram, "iteration_tokens_total", "Tokens run through the model per step.",
                                     buckets=[1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384])
        make(Gauge, "cache_config_info", "The KV cache's configuration (value 1).",
             tuple(cache_config)).labels(**cache_config).set(1)
        make(Gauge, "attention_backend_info", "The attention implementation the engine runs (value 1).",
             ("backend",)).labels(backend=attention_backend).set(1)

        # Requests.
        self.finished = by_label(Counter, "request_success", "Finished requests by finish reason.",
                                 "finished_reason", FINISH_REASONS)
        self.rejected = by_label(Counter, "request_rejected", "Requests refused before they reached the engine.",
                                 "cause", REJECT_CAUSES)
        self.timeouts = make(Counter, "request_timeouts", "Requests ended by their timeout.")
        self.ttft = make(Histogram, "time_to_first_token_seconds", "Time to first token.", buckets=_LATENCY_BUCKETS)
        self.itl = make(Histogram, "inter_token_latency_seconds", "Time between consecutive outputs of a request.",
                        buckets=_LATENCY_BUCKETS)
        self.e2e = make(Histogram, "e2e_request_latency_seconds", "Arrival to end of a request.",
                        buckets=_REQUEST_BUCKETS)
        self.queue_time = make(Histogram, "request_queue_time_seconds", "Time a request waited for admission.",
                               buckets=_REQUEST_BUCKETS)
        length_buckets = _1_2_5_buckets(max_model_len)
        self.request_prompt_tokens = make(Histogram, "request_prompt_tokens", "Prompt length of finished requests.",
                                          buckets=length_buckets)
        self.request_generation_tokens = make(Histogram, "request_generation_tokens",
                                              "Generated tokens of finished requests (all samples).",
                                              buckets=length_buckets)
        self.request_max_tokens = make(Histogram, "request_params_max_tokens", "The max_tokens requests asked for.",
                                       buckets=length_buckets)
        self.request_n = make(Histogram, "request_params_n", "The n requests asked for.", buckets=[1, 2, 5, 10, 20])

        # vLLM's LoRA gauge, under its name and labels alone (no model_name: routers such as the Gateway API
        # Inference Extension read it so): the adapters of running and of waiting requests, comma-joined,
        # and max_lora; its value is when it was last set (seconds since the epoch), so the newest series
        # is the current one.
        self._max_loras = None if max_loras is None else str(max_loras)
        self.lora_info = None if max_loras is None else Gauge(
            vllm_metrics.PREFIX + "lora_requests_info", "Running stats on LoRA requests.",
            ["max_lora", "waiting_lora_adapters", "running_lora_adapters"], registry=registry)

    def record(self, scheduler: SchedulerStats, iteration: IterationStats) -> None:
        self.running.set(scheduler.num_running)
        self.waiting.set(scheduler.num_waiting)
        self.kv_usage.set(scheduler.kv_cache_usage)
        self.kv_blocks["used"].set(scheduler.num_used_blocks)
        self.kv_blocks["cached"].set(scheduler.num_cached_blocks)
        self.kv_blocks["free"].set(scheduler.num_free_blocks)
        for counter, field in self._engine_counters:
            counter.inc(getattr(scheduler, field) - (getattr(self._previous, field) if self._previous else 0))
        before = self._previous.spec_decode_accepted_per_position if self._previous else ()
        for position, total in enumerate(scheduler.spec_decode_accepted_per_position):
            self.spec_per_position.labels(position=str(position)).inc(
                total - (before[position] if position < len(before) else 0))
        self._previous = scheduler
        if self.lora_info is not None:
            self.lora_info.labels(max_lora=self._max_loras,
                                  waiting_lora_adapters=",".join(scheduler.waiting_lora_adapters),
                                  running_lora_adapters=",".join(scheduler.running_lora_adapters)).set_to_current_time()

        if iteration.step_time is not None:
            self.step_time.observe(iteration.step_time)
            self.step_device_time.observe(iteration.device_time)
            self.step_host_time.observe(iteration.host_time)
            self.iteration_tokens.observe(iteration.num_batched_tokens)
        self.prompt_tokens.inc(iteration.num_prompt_tokens)
        self.generation_tokens.inc(iteration.num_generation_tokens)
        for value in iteration.time_to_first_tokens:
            self.ttft.observe(value)
        for value in iteration.inter_token_latencies:
            self.itl.observe(value)
        for value in iteration.queue_times:
            self.queue_time.observe(value)
        for request in iteration.finished:
            self.finished[request.finish_reason].inc()
            if request.finish_reason == "timeout":
                self.timeouts.inc()
            self.e2e.observe(request.e2e_latency)
            self.request_prompt_tokens.observe(request.num_prompt_tokens)
            self.request_generation_tokens.observe(request.num_generation_tokens)
            self.request_max_tokens.observe(request.max_tokens)
            self.request_n.observe(request.n)

    def reject(self, cause: str) -> None:
        self.rejected[cause].inc()
