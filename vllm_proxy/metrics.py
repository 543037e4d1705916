"""Prometheus metrics, on one explicit registry owned by the application (no globals).

The series every request updates (requests, durations, time to first byte, tokens) are kept
as plain numbers per model (`RequestSeries`) and turned into metric families when scraped
(`_RequestCollector`): a request then costs a few additions, not five prometheus_client
updates, each taking a lock. Everything the proxy
updates runs on the event loop, as does the scrape, so nothing is shared across threads.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
START_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 90, 120, 180, 300, 600)


class Buckets:
    """A histogram's counts (per bucket, not yet cumulative) and sum."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one: above every bound (+Inf)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1  # bucket: value <= bound
        self.sum += value

    def cumulative(self) -> list[tuple[str, float]]:
        out: list[tuple[str, float]] = []
        total = 0
        for bound, count in zip((*self.bounds, float("inf")), self.counts, strict=True):
            total += count
            out.append((floatToGoString(bound), total))
        return out


class RequestSeries:
    """What the request path counts for one model; exported as ``vllm_requests_total``,
    ``vllm_request_duration_seconds``, ``vllm_proxy_time_to_first_byte_seconds`` and the token
    counters."""

    __slots__ = ("completion", "duration", "prompt", "statuses", "ttfb")

    def __init__(self) -> None:
        self.statuses: dict[str, int] = {}
        self.duration = Buckets(LATENCY_BUCKETS)
        self.ttfb = Buckets(LATENCY_BUCKETS)
        self.prompt = 0
        self.completion = 0

    def count(self, status: str) -> None:
        self.statuses[status] = self.statuses.get(status, 0) + 1


class _RequestCollector:
    """The `RequestSeries` of every model, as metric families at scrape time."""

    def __init__(self, series: dict[str, RequestSeries]) -> None:
        self.series = series

    def collect(self) -> Iterator[Metric]:
        requests = CounterMetricFamily(
            "vllm_requests", "Requests routed to a model", labels=["model_id", "status"]
        )
        duration = HistogramMetricFamily(
            "vllm_request_duration_seconds",
            "Time from request arrival to the last byte sent",
            labels=["model_id"],
        )
        ttfb = HistogramMetricFamily(
            "vllm_proxy_time_to_first_byte_seconds",
            "Time from request arrival to the first response byte sent (cold starts included)",
            labels=["model_id"],
        )
        prompt = CounterMetricFamily(
            "vllm_proxy_prompt_tokens", "Prompt tokens (from responses' usage)", labels=["model_id"]
        )
        completion = CounterMetricFamily(
            "vllm_proxy_completion_tokens",
            "Completion tokens (from responses' usage; streams: the final usage chunk)",
            labels=["model_id"],
        )
        for model, s in sorted(self.series.items()):
            for status, n in sorted(s.statuses.items()):
                requests.add_metric([model, status], n)
            duration.add_metric([model], s.duration.cumulative(), s.duration.sum)
            ttfb.add_metric([model], s.ttfb.cumulative(), s.ttfb.sum)
            prompt.add_metric([model], s.prompt)
            completion.add_metric([model], s.completion)
        yield from (requests, duration, ttfb, prompt, completion)


class KeySeries:
    """What the request path counts for one API key (by its label, never the key): exported
    as ``vllm_proxy_key_requests_total``, ``vllm_proxy_key_rejected_total`` and the key's
    token counters."""

    __slots__ = ("completion", "prompt", "rejected", "requests")

    def __init__(self) -> None:
        self.requests = 0
        self.rejected: dict[str, int] = {}
        self.prompt = 0
        self.completion = 0

    def reject(self, reason: str) -> None:
        self.rejected[reason] = self.rejected.get(reason, 0) + 1


class _KeyCollector:
    """The `KeySeries` of every configured API key, as metric families at scrape time."""

    def __init__(self, series: dict[str, KeySeries]) -> None:
        self.series = series

    def collect(self) -> Iterator[Metric]:
        requests = CounterMetricFamily(
            "vllm_proxy_key_requests",
            "Requests (uploads and realtime sessions included) on the model routes per API key",
            labels=["key"],
        )
        rejected = CounterMetricFamily(
            "vllm_proxy_key_rejected",
            "Requests refused with 429 for a limit of their API key",
            labels=["key", "reason"],
        )
        prompt = CounterMetricFamily(
            "vllm_proxy_key_prompt_tokens", "Prompt tokens per API key", labels=["key"]
        )
        completion = CounterMetricFamily(
            "vllm_proxy_key_completion_tokens", "Completion tokens per API key", labels=["key"]
        )
        for key, s in sorted(self.series.items()):
            requests.add_metric([key], s.requests)
            for reason, n in sorted(s.rejected.items()):
                rejected.add_metric([key, reason], n)
            prompt.add_metric([key], s.prompt)
            completion.add_metric([key], s.completion)
        yield from (requests, rejected, prompt, completion)


class Metrics:
    """Every series the proxy exports; names follow the design document."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        #: Per model: what the request path counts (see the module docstring).
        self.request_series: dict[str, RequestSeries] = {}
        r.register(_RequestCollector(self.request_series))
        #: Per configured API key, by its label.
        self.keys: dict[str, KeySeries] = {}
        r.register(_KeyCollector(self.keys))
        self.loaded = Gauge(
            "vllm_model_loaded",
            "1 while any instance of the model serves requests",
            ["model_id"],
            registry=r,
        )
        self.active = Gauge(
            "vllm_model_requests_active",
            "Requests holding a lease on an instance of the model",
            ["model_id"],
            registry=r,
        )
        self.host_pinned = Gauge(
            "vllm_proxy_instance_host_pinned_mb",
            "Host RAM the instance's engine keeps pinned after its sleeps (measured: the growth"
            " of its processes' resident memory across each /sleep; PyTorch keeps the pinned"
            " blocks cached after the wake)",
            ["model_id", "instance"],
            registry=r,
        )
        self.instance_active = Gauge(
            "vllm_proxy_instance_requests_active",
            "Requests holding a lease on the instance",
            ["model_id", "instance"],
            registry=r,
        )
        self.state = Gauge(
            "vllm_proxy_model_state",
            "1 for the model's summary state (running while any instance serves)",
            ["model_id", "state"],
            registry=r,
        )
        self.instance_state = Gauge(
            "vllm_proxy_instance_state",
            "1 for the current state of each live engine instance",
            ["model_id", "instance", "state"],
            registry=r,
        )
        self.starts = Histogram(
            "vllm_proxy_engine_start_duration_seconds",
            "Engine cold start: spawn to first healthy answer",
            ["model_id"],
            buckets=START_BUCKETS,
            registry=r,
        )
        self.transitions = Histogram(
            "vllm_proxy_engine_transition_seconds",
            "Engine transitions by kind: cold_start (spawn to ready, warm-up included), sleep"
            " (the /sleep call), wake_l1 and wake_l2 (wake_up to serving, warm-up included)",
            ["model_id", "kind"],
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, *START_BUCKETS[1:]),
            registry=r,
        )
        self.sleep_level = Gauge(
            "vllm_proxy_instance_sleep_level",
            "Sleep level of each sleeping instance (1: weights in host RAM, 2: discarded;"
            " 0: awake again)",
            ["model_id", "instance"],
            registry=r,
        )
        self.instances = Gauge(
            "vllm_proxy_instances",
            "Live instances of the model in each state",
            ["model_id", "state"],
            registry=r,
        )
        self.restarts = Counter(
            "vllm_proxy_engine_restarts_total",
            "Engines that exited unexpectedly or failed to start",
            ["model_id", "reason"],
            registry=r,
        )
        self.wake_verify_failures = Counter(
            "vllm_proxy_wake_verify_failures_total",
            "Wakes whose engine answered the fixed check request differently from its start"
            " (sleep.verify_wake): the engine was stopped and a new one started",
            ["model_id", "level"],
            registry=r,
        )
        self.sleep_level_barred = Gauge(
            "vllm_proxy_sleep_level_barred",
            "1 while a model no longer uses a sleep level because its wakes from it kept failing"
            " the wake check (cleared by POST /admin/models/{name}/wake_check/clear)",
            ["model_id", "level"],
            registry=r,
        )
        self.wake_verify = Histogram(
            "vllm_proxy_wake_verify_seconds",
            "Time the check of a wake took (part of wake_l1/wake_l2)",
            ["model_id"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )

        self.read_ahead_bytes = Counter(
            "vllm_proxy_read_ahead_bytes_total",
            "Bytes of weight files that the proxy's read-ahead brought into the page cache"
            " (resident afterwards less before, by mincore; never the files' sizes)",
            ["model_id"],
            registry=r,
        )
        self.read_ahead_files = Counter(
            "vllm_proxy_read_ahead_files_total",
            "Weight files the proxy read ahead into the page cache",
            ["model_id"],
            registry=r,
        )
        self.evictions = Counter(
            "vllm_proxy_evictions_total",
            "Engines stopped to free memory or because they sat idle",
            ["model_id", "reason"],
            registry=r,
        )
        self.queue_depth = Gauge(
            "vllm_proxy_admission_queue_depth",
            "Requests waiting for the model to be admitted (memory) and started",
            ["model_id"],
            registry=r,
        )
        self.queue_wait = Histogram(
            "vllm_proxy_admission_wait_seconds",
            "Time a start or a wake waited for its turn and for GPU memory",
            ["model_id"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.memory_estimate = Gauge(
            "vllm_proxy_model_memory_estimate_mb",
            "Planned GPU memory per device for the model",
            ["model_id"],
            registry=r,
        )
        self.memory_measured = Gauge(
            "vllm_proxy_instance_memory_measured_mb",
            "GPU memory per device the running instance was measured to hold (NVML)",
            ["model_id", "instance"],
            registry=r,
        )
        self.adapter_loads = Counter(
            "vllm_proxy_adapter_loads_total",
            "LoRA adapter registrations on an engine (load_lora_adapter calls) by result: ok,"
            " not_found, refused (the engine's 4xx), failed (5xx, no answer)",
            ["model_id", "adapter", "result"],
            registry=r,
        )
        self.adapter_unloads = Counter(
            "vllm_proxy_adapter_unloads_total",
            "LoRA adapters unregistered from an engine to make room for another (max_adapters)",
            ["model_id", "adapter"],
            registry=r,
        )
        self.adapter_requests = Counter(
            "vllm_proxy_adapter_requests_total",
            "Requests that named a LoRA adapter (by its name or an alias)",
            ["model_id", "adapter"],
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

    def key_series(self, label: str) -> KeySeries:
        """The series of the API key `label` (made on first use)."""
        series = self.keys.get(label)
        if series is None:
            series = self.keys[label] = KeySeries()
        return series

    def keep_keys(self, labels: set[str]) -> None:
        """After a (re)load: drop the series of keys no longer configured, so that the
        series stay as many as the keys."""
        for label in [k for k in self.keys if k not in labels]:
            del self.keys[label]

    def series(self, model: str) -> RequestSeries:
        """The request path's series of `model` (made on first use; kept after its removal,
        as counters are)."""
        series = self.request_series.get(model)
        if series is None:
            series = self.request_series[model] = RequestSeries()
        return series

    def set_model_state(self, model: str, old: str | None, new: str, loaded: bool) -> None:
        if old is not None:
            self.state.labels(model, old).set(0)
        self.state.labels(model, new).set(1)
        self.loaded.labels(model).set(1 if loaded else 0)

    def set_instance_state(self, model: str, instance: str, old: str | None, new: str) -> None:
        if old is not None:
            _remove(self.instance_state, model, instance, old)
            self.instances.labels(model, old).dec()
        self.instance_state.labels(model, instance, new).set(1)
        self.instances.labels(model, new).inc()

    def instance_asleep(
        self, model: str, instance: str, level: int, seconds: float, pinned: int | None
    ) -> None:
        """An engine's /sleep returned after `seconds` at `level`, pinning `pinned` MiB of host
        RAM (None: not known)."""
        if pinned is not None:
            self.host_pinned.labels(model, instance).set(pinned)
        self.transitions.labels(model, "sleep").observe(seconds)
        self.sleep_level.labels(model, instance).set(level)

    def instance_awake(self, model: str, instance: str, level: int, seconds: float) -> None:
        """An engine woke from `level` after `seconds`."""
        self.transitions.labels(model, f"wake_l{level}").observe(seconds)
        self.sleep_level.labels(model, instance).set(0)

    def forget_sleep(self, model: str, instance: str) -> None:
        """An engine that slept is being stopped: no sleep level any more."""
        _remove(self.sleep_level, model, instance)

    def forget_instance(self, model: str, instance: str) -> None:
        """Drop an ended instance's series (ids are never reused: they would pile up)."""
        for labels in _label_sets(self.instance_state):
            if labels["model_id"] == model and labels["instance"] == instance:
                _remove(self.instance_state, model, instance, labels["state"])
                self.instances.labels(model, labels["state"]).dec()
        _remove(self.instance_active, model, instance)
        _remove(self.memory_measured, model, instance)
        _remove(self.sleep_level, model, instance)
        _remove(self.host_pinned, model, instance)

    def forget_model(self, model: str) -> None:
        """Drop a removed model's gauges (its counters and histograms stay)."""
        for metric in (self.loaded, self.active, self.queue_depth, self.memory_estimate):
            _remove(metric, model)
        for labels in _label_sets(self.state):
            if labels["model_id"] == model:
                _remove(self.state, model, labels["state"])
        for labels in _label_sets(self.instances):
            if labels["model_id"] == model:
                _remove(self.instances, model, labels["state"])

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _remove(metric: Gauge, *labels: str) -> None:
    try:
        metric.remove(*labels)
    except KeyError:
        pass


def _label_sets(metric: Gauge) -> list[dict[str, str]]:
    return [sample.labels for family in metric.collect() for sample in family.samples]
