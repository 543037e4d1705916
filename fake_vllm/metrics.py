"""vLLM's Prometheus series for one model, rendered as text by hand."""

from bisect import bisect_left
from collections.abc import Mapping

from .settings import E2E_BUCKETS, FINISH_REASONS, SLEEP_LEVELS, TTFT_BUCKETS


def _num(value: float) -> str:
    return repr(float(value))


class Histogram:
    """A Prometheus histogram with fixed bounds, rendered by hand."""

    __slots__ = ("bounds", "count", "counts", "total")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.total = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.total += value
        self.count += 1

    def lines(self, name: str, labels: str) -> list[str]:
        out = [f"# TYPE {name} histogram"]
        cumulative = 0
        for bound, n in zip(self.bounds, self.counts, strict=False):
            cumulative += n
            out.append(f'{name}_bucket{{{labels},le="{bound!r}"}} {_num(cumulative)}')
        out.append(f'{name}_bucket{{{labels},le="+Inf"}} {_num(self.count)}')
        out.append(f"{name}_count{{{labels}}} {_num(self.count)}")
        out.append(f"{name}_sum{{{labels}}} {_num(self.total)}")
        return out


class Metrics:
    """vLLM's engine series for one model (labels ``engine="0",model_name=...``).

    Besides them, fake-only ``fake_engine:*`` series count what the sleep-mode tests check:
    sleeps by level, wakes, weight reloads, prefix-cache resets, requests that arrived while
    asleep, completions served from discarded weights, sleep/wake calls in flight and the bytes
    held on the GPU.
    """

    def __init__(self, model_name: str) -> None:
        escaped = model_name.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
        self.labels = f'engine="0",model_name="{escaped}"'
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.finished = dict.fromkeys(FINISH_REASONS, 0)
        self.ttft = Histogram(TTFT_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)
        self.sleeps = dict.fromkeys(SLEEP_LEVELS, 0)
        self.wakes = 0
        self.reload_weights = 0
        self.reset_prefix_cache = 0
        self.requests_while_asleep = 0
        self.garbage_completions = 0
        self.in_flight = {"sleep": 0, "wake": 0}

    def record(
        self, prompt: int, generated: int, reason: str, ttft: float | None, e2e: float
    ) -> None:
        self.prompt_tokens += prompt
        self.generation_tokens += generated
        self.finished[reason] += 1
        if ttft is not None:
            self.ttft.observe(ttft)
        self.e2e.observe(e2e)

    def _sample(self, name: str, kind: str, value: float) -> list[str]:
        return self._labelled(name, kind, "", {"": value})

    def _labelled(
        self, name: str, kind: str, label: str, values: Mapping[str, float], fake: bool = False
    ) -> list[str]:
        """One family. A vLLM counter's TYPE line drops ``_total``; a fake one keeps it, as the
        current prometheus_client writes it, so that its parser folds the samples into one
        counter family.
        """
        base = name.removesuffix("_total") if kind == "counter" and not fake else name
        out = [f"# TYPE {base} {kind}"]
        if not label:
            return [*out, f"{name}{{{self.labels}}} {_num(values[''])}"]
        for key, value in values.items():
            out.append(f'{name}{{{self.labels},{label}="{key}"}} {_num(value)}')
        return out

    def _fake_series(self, gpu_bytes: int) -> list[str]:
        levels = {str(level): count for level, count in self.sleeps.items()}
        out = self._labelled("fake_engine:sleeps_total", "counter", "level", levels, fake=True)
        for name, value in [
            ("fake_engine:wakes_total", self.wakes),
            ("fake_engine:reload_weights_total", self.reload_weights),
            ("fake_engine:reset_prefix_cache_total", self.reset_prefix_cache),
            ("fake_engine:requests_while_asleep_total", self.requests_while_asleep),
            ("fake_engine:garbage_completions_total", self.garbage_completions),
        ]:
            out += self._labelled(name, "counter", "", {"": value}, fake=True)
        name = "fake_engine:sleep_operations_in_flight"
        out += self._labelled(name, "gauge", "operation", self.in_flight, fake=True)
        out += self._sample("fake_engine:gpu_bytes", "gauge", gpu_bytes)
        return out

    def render(
        self,
        running: int,
        waiting: int,
        kv_usage: float,
        sleep: dict[str, int],
        gpu_bytes: int,
    ) -> str:
        out = self._sample("vllm:num_requests_running", "gauge", running)
        out += self._sample("vllm:num_requests_waiting", "gauge", waiting)
        out += self._sample("vllm:kv_cache_usage_perc", "gauge", kv_usage)
        out += self._labelled("vllm:engine_sleep_state", "gauge", "sleep_state", sleep)
        out += self._sample("vllm:prompt_tokens_total", "counter", self.prompt_tokens)
        out += self._sample("vllm:generation_tokens_total", "counter", self.generation_tokens)
        name = "vllm:request_success_total"
        out += self._labelled(name, "counter", "finished_reason", self.finished)
        out += self.ttft.lines("vllm:time_to_first_token_seconds", self.labels)
        out += self.e2e.lines("vllm:e2e_request_latency_seconds", self.labels)
        out += self._fake_series(gpu_bytes)
        return "\n".join(out) + "\n"
