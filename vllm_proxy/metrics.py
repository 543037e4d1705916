"""Prometheus metrics, on one explicit registry owned by the application (no globals)."""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
START_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 90, 120, 180, 300, 600)


class Metrics:
    """Every series the proxy exports; names follow the design document."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "vllm_requests_total", "Requests routed to a model", ["model_id", "status"], registry=r
        )
        self.duration = Histogram(
            "vllm_request_duration_seconds",
            "Time from request arrival to the last byte sent",
            ["model_id"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.ttfb = Histogram(
            "vllm_time_to_first_byte_seconds",
            "Time from request arrival to the first response byte sent (cold starts included)",
            ["model_id"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "vllm_prompt_tokens", "Prompt tokens (from responses' usage)", ["model_id"], registry=r
        )
        self.completion_tokens = Counter(
            "vllm_completion_tokens",
            "Completion tokens (from responses' usage; streams: the final usage chunk)",
            ["model_id"],
            registry=r,
        )
        self.loaded = Gauge(
            "vllm_model_loaded", "1 while the model's engine is running", ["model_id"], registry=r
        )
        self.active = Gauge(
            "vllm_model_requests_active",
            "Requests holding a lease on the model",
            ["model_id"],
            registry=r,
        )
        self.state = Gauge(
            "vllm_model_state", "1 for the model's current state", ["model_id", "state"], registry=r
        )
        self.starts = Histogram(
            "vllm_engine_start_duration_seconds",
            "Engine cold start: spawn to first healthy answer",
            ["model_id"],
            buckets=START_BUCKETS,
            registry=r,
        )
        self.restarts = Counter(
            "vllm_engine_restarts_total",
            "Engines that exited unexpectedly or failed to start",
            ["model_id", "reason"],
            registry=r,
        )

        self.evictions = Counter(
            "vllm_evictions_total",
            "Engines stopped to free memory or because they sat idle",
            ["model_id", "reason"],
            registry=r,
        )
        self.queue_depth = Gauge(
            "vllm_admission_queue_depth",
            "Requests waiting for the model to be admitted (memory) and started",
            ["model_id"],
            registry=r,
        )
        self.queue_wait = Histogram(
            "vllm_admission_wait_seconds",
            "Time a start waited for GPU memory",
            ["model_id"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.memory_estimate = Gauge(
            "vllm_model_memory_estimate_mb",
            "Planned GPU memory per device for the model",
            ["model_id"],
            registry=r,
        )
        self.memory_measured = Gauge(
            "vllm_model_memory_measured_mb",
            "GPU memory per device the running engine was measured to hold (NVML)",
            ["model_id"],
            registry=r,
        )
        self.gpu_total = Gauge(
            "vllm_gpu_memory_total_mb", "GPU memory size", ["gpu_id"], registry=r
        )
        self.gpu_used = Gauge(
            "vllm_gpu_memory_used_mb", "GPU memory in use", ["gpu_id"], registry=r
        )
        self.gpu_util = Gauge(
            "vllm_gpu_utilization_percent", "GPU compute utilisation", ["gpu_id"], registry=r
        )

    def set_state(self, model: str, old: str | None, new: str, loaded: bool) -> None:
        if old is not None:
            self.state.labels(model, old).set(0)
        self.state.labels(model, new).set(1)
        self.loaded.labels(model).set(1 if loaded else 0)

    def forget(self, model: str, states: list[str]) -> None:
        """Drop a removed model's series."""
        for metric in (self.loaded, self.active):
            try:
                metric.remove(model)
            except KeyError:
                pass
        for s in states:
            try:
                self.state.remove(model, s)
            except KeyError:
                pass

    def render(self) -> bytes:
        return generate_latest(self.registry)
