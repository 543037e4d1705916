"""vLLM's Prometheus series for one model, rendered as text by hand."""

from bisect import bisect_left

from .settings import E2E_BUCKETS, FINISH_REASONS, TTFT_BUCKETS


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
    """vLLM's engine series for one model (labels ``engine="0",model_name=...``)."""

    def __init__(self, model_name: str) -> None:
        escaped = model_name.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
        self.labels = f'engine="0",model_name="{escaped}"'
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.finished = dict.fromkeys(FINISH_REASONS, 0)
        self.ttft = Histogram(TTFT_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)

    def record(
        self, prompt: int, generated: int, reason: str, ttft: float | None, e2e: float
    ) -> None:
        self.prompt_tokens += prompt
        self.generation_tokens += generated
        self.finished[reason] += 1
        if ttft is not None:
            self.ttft.observe(ttft)
        self.e2e.observe(e2e)

    def _sample(self, name: str, kind: str, value: float, extra: str = "") -> list[str]:
        base = name.removesuffix("_total") if kind == "counter" else name
        return [f"# TYPE {base} {kind}", f"{name}{{{self.labels}{extra}}} {_num(value)}"]

    def render(self, running: int, waiting: int, kv_usage: float, sleep: dict[str, int]) -> str:
        out = self._sample("vllm:num_requests_running", "gauge", running)
        out += self._sample("vllm:num_requests_waiting", "gauge", waiting)
        out += self._sample("vllm:kv_cache_usage_perc", "gauge", kv_usage)
        out.append("# TYPE vllm:engine_sleep_state gauge")
        for state, value in sleep.items():
            out.append(
                f'vllm:engine_sleep_state{{{self.labels},sleep_state="{state}"}} {_num(value)}'
            )
        out += self._sample("vllm:prompt_tokens_total", "counter", self.prompt_tokens)
        out += self._sample("vllm:generation_tokens_total", "counter", self.generation_tokens)
        out.append("# TYPE vllm:request_success counter")
        for reason, count in self.finished.items():
            label = f',finished_reason="{reason}"'
            out.append(f"vllm:request_success_total{{{self.labels}{label}}} {_num(count)}")
        out += self.ttft.lines("vllm:time_to_first_token_seconds", self.labels)
        out += self.e2e.lines("vllm:e2e_request_latency_seconds", self.labels)
        return "\n".join(out) + "\n"
