"""What the server adds around the API for its operators, wired into an app in one call: latency
objectives (slo.py), the circuit breaker and its readiness route (breaker.py), the live dashboard
(dashboard.py).

    guardrails = add_guardrails(app, registry, config, metrics)   # in build_app
    engine = AsyncLLMEngine(..., stat_loggers=[metrics, *guardrails.stat_loggers])
    guardrails.bind(engine)                                       # in the lifespan, once the loop runs
"""

import dataclasses

from fastapi import FastAPI
from prometheus_client import CollectorRegistry

from paged_jax.serving.async_engine import AsyncLLMEngine, StatLogger
from paged_jax.serving.breaker import CircuitBreaker, FailFast, readiness_router
from paged_jax.serving.dashboard import DashboardFeed, dashboard_router
from paged_jax.serving.metrics import PrometheusMetrics
from paged_jax.serving.slo import Objective, SloGuard


@dataclasses.dataclass(frozen=True)
class Guardrails:
    guard: SloGuard
    breaker: CircuitBreaker
    feed: DashboardFeed

    @property
    def stat_loggers(self) -> list[StatLogger]:
        return [self.guard, self.breaker, self.feed]

    def bind(self, engine: AsyncLLMEngine) -> None:
        """Hand them the engine loop they watch, once it runs."""
        for part in self.stat_loggers:
            part.engine = engine


def add_guardrails(app: FastAPI, registry: CollectorRegistry, config, metrics: PrometheusMetrics) -> Guardrails:
    """Add the breaker's middleware (call it where it should wrap the middleware added before it), the
    readiness and dashboard routes, and their metrics in `registry`. config: the server's ServerConfig."""
    name = config.served_model_name
    guardrails = Guardrails(SloGuard(Objective(config.slo_ttft_ms, config.slo_tpot_ms), registry, name),
                            CircuitBreaker(registry, name, threshold=config.breaker_threshold),
                            DashboardFeed(registry))
    app.add_middleware(FailFast, breaker=guardrails.breaker, on_reject=lambda: metrics.reject("circuit_open"))
    app.include_router(readiness_router(guardrails.breaker))
    app.include_router(dashboard_router(guardrails.feed, config.api_key,
                                        on_reject=lambda: metrics.reject("unauthorized")))
    return guardrails
