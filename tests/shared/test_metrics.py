"""The request path's series: plain counts on the request path, metric families when scraped."""

from __future__ import annotations

from prometheus_client import Histogram
from prometheus_client.parser import text_string_to_metric_families

from vllm_proxy.metrics import LATENCY_BUCKETS, Buckets, Metrics


def samples(m: Metrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(m.render().decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_buckets_count_as_prometheus_client_does() -> None:
    """Same values, same cumulative buckets and sum as prometheus_client's own histogram: a
    value equal to a bound counts in that bound's bucket, above the last one only in +Inf."""
    values = [0.0, 0.005, 0.0051, 0.3, 1, 1.0000001, 599.9, 600, 600.1, 1e9]
    mine = Buckets(LATENCY_BUCKETS)
    theirs = Histogram("h", "h", buckets=LATENCY_BUCKETS)
    for v in values:
        mine.observe(v)
        theirs.observe(v)
    [family] = theirs.collect()
    expected = [(s.labels["le"], s.value) for s in family.samples if s.name == "h_bucket"]
    assert mine.cumulative() == expected
    assert mine.sum == sum(values)


def test_request_series_are_exported_with_their_names_types_and_labels() -> None:
    m = Metrics()
    s = m.series("m1")
    assert m.series("m1") is s
    for status in ("200", "200", "499"):
        s.count(status)
    s.duration.observe(0.02)
    s.duration.observe(3)
    s.ttfb.observe(0.004)
    s.prompt += 7
    s.completion += 11
    m.series("m2").count("503")
    got = samples(m)
    assert got[("vllm_requests_total", (("model_id", "m1"), ("status", "200")))] == 2
    assert got[("vllm_requests_total", (("model_id", "m1"), ("status", "499")))] == 1
    assert got[("vllm_requests_total", (("model_id", "m2"), ("status", "503")))] == 1
    assert got[("vllm_request_duration_seconds_count", (("model_id", "m1"),))] == 2
    assert got[("vllm_request_duration_seconds_sum", (("model_id", "m1"),))] == 3.02
    assert got[("vllm_request_duration_seconds_bucket", (("le", "0.025"), ("model_id", "m1")))] == 1
    assert got[("vllm_request_duration_seconds_bucket", (("le", "+Inf"), ("model_id", "m1")))] == 2
    assert got[("vllm_proxy_time_to_first_byte_seconds_count", (("model_id", "m1"),))] == 1
    assert got[("vllm_proxy_time_to_first_byte_seconds_count", (("model_id", "m2"),))] == 0
    assert got[("vllm_proxy_prompt_tokens_total", (("model_id", "m1"),))] == 7
    assert got[("vllm_proxy_completion_tokens_total", (("model_id", "m1"),))] == 11
    types = {f.name: f.type for f in text_string_to_metric_families(m.render().decode())}
    assert types["vllm_requests"] == "counter"
    assert types["vllm_request_duration_seconds"] == "histogram"
    assert types["vllm_proxy_time_to_first_byte_seconds"] == "histogram"
    assert types["vllm_proxy_prompt_tokens"] == "counter"


def test_a_model_removed_keeps_its_counts() -> None:
    m = Metrics()
    m.series("gone").count("200")
    m.forget_model("gone")
    assert samples(m)[("vllm_requests_total", (("model_id", "gone"), ("status", "200")))] == 1
