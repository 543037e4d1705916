"""Operations artefacts: the systemd unit, a real Prometheus scraping /metrics, the dashboard."""

from __future__ import annotations

import asyncio
import configparser
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import aiohttp
import pytest
from kit import StartProxy, free_port, healthy, make_config, wait_for
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.parser import text_string_to_metric_families

from vllm_proxy.config import EngineConfig, ServerConfig, parse_config
from vllm_proxy.metrics import Metrics

ROOT = Path(__file__).resolve().parents[2]
UNIT = ROOT / "systemd" / "vllm-proxy.service"
DASHBOARD = ROOT / "docs" / "grafana-dashboard.json"
SYSTEMD_ANALYZE = "/usr/bin/systemd-analyze"
PROMETHEUS = "/usr/bin/prometheus"
JOB = "vllm-proxy"


class Series(NamedTuple):
    kind: str
    labels: tuple[str, ...]


#: The series the proxy exports (type, label names): what the dashboard may query. The design
#: document's names stay; the proxy's own additions carry the ``vllm_proxy_`` prefix.
EXPORTED: dict[str, Series] = {
    "vllm_requests_total": Series("counter", ("model_id", "status")),
    "vllm_request_duration_seconds": Series("histogram", ("model_id",)),
    "vllm_model_loaded": Series("gauge", ("model_id",)),
    "vllm_model_requests_active": Series("gauge", ("model_id",)),
    "vllm_gpu_memory_total_mb": Series("gauge", ("gpu_id",)),
    "vllm_gpu_memory_used_mb": Series("gauge", ("gpu_id",)),
    "vllm_gpu_utilization_percent": Series("gauge", ("gpu_id",)),
    "vllm_proxy_time_to_first_byte_seconds": Series("histogram", ("model_id",)),
    "vllm_proxy_prompt_tokens_total": Series("counter", ("model_id",)),
    "vllm_proxy_completion_tokens_total": Series("counter", ("model_id",)),
    "vllm_proxy_key_requests_total": Series("counter", ("key",)),
    "vllm_proxy_key_rejected_total": Series("counter", ("key", "reason")),
    "vllm_proxy_key_prompt_tokens_total": Series("counter", ("key",)),
    "vllm_proxy_key_completion_tokens_total": Series("counter", ("key",)),
    "vllm_proxy_instance_requests_active": Series("gauge", ("model_id", "instance")),
    "vllm_proxy_model_state": Series("gauge", ("model_id", "state")),
    "vllm_proxy_instance_state": Series("gauge", ("model_id", "instance", "state")),
    "vllm_proxy_instances": Series("gauge", ("model_id", "state")),
    "vllm_proxy_instance_sleep_level": Series("gauge", ("model_id", "instance")),
    "vllm_proxy_engine_transition_seconds": Series("histogram", ("model_id", "kind")),
    "vllm_proxy_engine_start_duration_seconds": Series("histogram", ("model_id",)),
    "vllm_proxy_engine_restarts_total": Series("counter", ("model_id", "reason")),
    "vllm_proxy_wake_verify_failures_total": Series("counter", ("model_id", "level")),
    "vllm_proxy_sleep_level_barred": Series("gauge", ("model_id", "level")),
    "vllm_proxy_wake_verify_seconds": Series("histogram", ("model_id",)),
    "vllm_proxy_evictions_total": Series("counter", ("model_id", "reason")),
    "vllm_proxy_read_ahead_bytes_total": Series("counter", ("model_id",)),
    "vllm_proxy_read_ahead_files_total": Series("counter", ("model_id",)),
    "vllm_proxy_admission_queue_depth": Series("gauge", ("model_id",)),
    "vllm_proxy_admission_wait_seconds": Series("histogram", ("model_id",)),
    "vllm_proxy_model_memory_estimate_mb": Series("gauge", ("model_id",)),
    "vllm_proxy_instance_memory_measured_mb": Series("gauge", ("model_id", "instance")),
    "vllm_proxy_instance_host_pinned_mb": Series("gauge", ("model_id", "instance")),
    "vllm_proxy_adapter_loads_total": Series("counter", ("model_id", "adapter", "result")),
    "vllm_proxy_adapter_unloads_total": Series("counter", ("model_id", "adapter")),
    "vllm_proxy_adapter_requests_total": Series("counter", ("model_id", "adapter")),
}
#: Gauges a proxy with a static GPU budget has once one request went through (no NVML: no
#: utilisation, no measured footprint); the dashboard's plain reads of them must return data.
PRESENT_AFTER_A_REQUEST = {
    "vllm_model_loaded",
    "vllm_model_requests_active",
    "vllm_gpu_memory_total_mb",
    "vllm_gpu_memory_used_mb",
    "vllm_proxy_instance_requests_active",
    "vllm_proxy_model_state",
    "vllm_proxy_instance_state",
    "vllm_proxy_admission_queue_depth",
    "vllm_proxy_model_memory_estimate_mb",
}
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")
#: Grafana's variables, replaced by what they mean for "all" when the query runs in Prometheus.
GRAFANA_VARS = {"$__rate_interval": "1m", "$__interval": "15s", "$proxy": ".*", "$model": ".*"}


def need(binary: str) -> None:
    if not os.access(binary, os.X_OK):
        pytest.fail(f"{binary} missing: run scripts/system-deps.sh (make test does)")


# --- systemd unit ---------------------------------------------------------------------------


class UnitParser(configparser.RawConfigParser):
    """A unit file's sections; keys keep their case, repeated keys keep the last value."""

    def optionxform(self, optionstr: str) -> str:
        return optionstr


def unit_sections(text: str) -> UnitParser:
    parser = UnitParser(strict=False, interpolation=None, delimiters=("=",))
    parser.read_string(text)
    return parser


def seconds(value: str) -> float:
    """A systemd time span such as `90`, `90s`, `1min 30s`."""
    units = {"": 1.0, "s": 1.0, "sec": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0, "ms": 0.001}
    total = 0.0
    for number, unit in re.findall(r"(\d+(?:\.\d+)?)\s*([a-z]*)", value):
        total += float(number) * units[unit]
    return total


def test_systemd_unit_verifies(tmp_path: Path) -> None:
    """`systemd-analyze verify` accepts the unit; only ExecStart's install path is swapped."""
    need(SYSTEMD_ANALYZE)
    text = UNIT.read_text()
    exec_start = unit_sections(text)["Service"]["ExecStart"]
    program, _, args = exec_start.partition(" ")
    assert program.startswith("/"), f"ExecStart must be an absolute path: {program}"
    assert "--config" in args
    adjusted = text
    if not Path(program).exists():
        stand_in = shutil.which("vllm-proxy", path=str(Path(sys.executable).parent))
        stand_in = stand_in or sys.executable
        adjusted = text.replace(f"ExecStart={program} ", f"ExecStart={stand_in} ", 1)
        assert adjusted != text
        print(f"adjusted for verify: ExecStart {program} -> {stand_in} (not installed here)")
    unit = tmp_path / UNIT.name
    unit.write_text(adjusted)

    done = subprocess.run(
        [SYSTEMD_ANALYZE, "verify", "--man=no", str(unit)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    output = done.stdout + done.stderr
    complaints = [line for line in output.splitlines() if UNIT.name in line]
    assert done.returncode == 0, output
    assert complaints == [], "\n".join(complaints)


def test_systemd_unit_directives() -> None:
    """The unit agrees with how the proxy runs: notify, signals, stop budget, restarts."""
    service = unit_sections(UNIT.read_text())["Service"]
    assert service["Type"] in ("notify", "notify-reload")
    assert service.get("NotifyAccess", "main") in ("main", "all")
    assert service["KillMode"] == "mixed", "the proxy stops its engine groups itself"
    assert service.get("KillSignal", "SIGTERM") in ("SIGTERM", "TERM", "15")
    budget = ServerConfig().drain_timeout_s + EngineConfig().stop_timeout_s
    assert seconds(service["TimeoutStopSec"]) > budget, "SIGKILL would cut the drain short"
    assert service.get("Restart") in ("on-failure", "always")
    assert int(service.get("LimitNOFILE", "0")) >= 4096
    exec_reload = service.get("ExecReload", "")
    if exec_reload:
        assert "HUP" in exec_reload and "$MAINPID" in exec_reload


# --- Grafana dashboard ----------------------------------------------------------------------


def walk_panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in panels:
        yield panel
        yield from walk_panels(panel.get("panels", []))


def dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return data


def dashboard_exprs() -> list[str]:
    return [
        target["expr"]
        for panel in walk_panels(dashboard()["panels"])
        for target in panel.get("targets", [])
        if "expr" in target
    ]


def metric_names(expr: str) -> set[str]:
    return set(re.findall(r"\bvllm_[a-z0-9_]+\b", expr))


def exported_name(name: str) -> tuple[str, str]:
    """(exported series, suffix) for a name as written in a query."""
    if name in EXPORTED:
        return name, ""
    for suffix in HISTOGRAM_SUFFIXES:
        base = name.removesuffix(suffix)
        if base != name and base in EXPORTED and EXPORTED[base].kind == "histogram":
            return base, suffix
    raise AssertionError(f"{name} is not a series the proxy exports")


def test_dashboard_is_importable() -> None:
    data = dashboard()
    assert 36 <= data["schemaVersion"] <= 41
    assert data["uid"] and data["title"]
    inputs = {i["name"]: i for i in data["__inputs"]}
    assert inputs["DS_PROMETHEUS"]["type"] == "datasource"
    assert inputs["DS_PROMETHEUS"]["pluginId"] == "prometheus"
    panels = list(walk_panels(data["panels"]))
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in panels:
        grid = panel["gridPos"]
        assert 0 <= grid["x"] and grid["x"] + grid["w"] <= 24, panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${DS_PROMETHEUS}", panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${DS_PROMETHEUS}", panel["title"]
    for var in data["templating"]["list"]:
        assert var["datasource"]["uid"] == "${DS_PROMETHEUS}"
    titles = " | ".join(p["title"].lower() for p in panels)
    for wanted in (
        "requests/s",
        "p50 / p95 / p99",
        "first byte",
        "active requests",
        "active requests by instance",
        "engine instances",
        "model state",
        "instance state",
        "engine start",
        "restarts",
        "evictions",
        "queue depth",
        "admission wait",
        "gpu memory",
        "gpu utilisation",
        "estimate vs measured",
        "tokens/s",
    ):
        assert wanted in titles, f"no panel for {wanted!r}"


def test_dashboard_queries_exported_series() -> None:
    exprs = dashboard_exprs()
    assert len(exprs) >= 15
    used: set[str] = set()
    for expr in exprs:
        names = metric_names(expr)
        assert names, f"query reads no vllm_ series: {expr}"
        for name in names:
            base, suffix = exported_name(name)
            used.add(base)
            kind = EXPORTED[base].kind
            if kind == "histogram":
                assert suffix, f"{name}: query a histogram through _bucket/_sum/_count"
            if kind == "counter" or suffix:
                assert re.search(rf"\b(rate|increase|irate)\(\s*{name}\b", expr), (
                    f"{name} is cumulative: query its rate or increase: {expr}"
                )
    assert used == set(EXPORTED), f"series without a panel: {set(EXPORTED) - used}"


def test_exported_series_match_the_registry() -> None:
    """EXPORTED, what the dashboard and the docs are checked against, is exactly what metrics.py
    registers and renders: the same names, types and label names, nothing more, nothing less."""
    metrics = Metrics()
    registered = {
        f.name + "_total" if f.type == "counter" else f.name: f.type
        for f in metrics.registry.collect()
    }
    assert registered == {name: s.kind for name, s in EXPORTED.items()}

    # The request path's series are plain counts exported by collectors (metrics.RequestSeries,
    # metrics.KeySeries); every other series is a prometheus_client metric.
    request_path = {
        "vllm_requests_total",
        "vllm_request_duration_seconds",
        "vllm_proxy_time_to_first_byte_seconds",
        "vllm_proxy_prompt_tokens_total",
        "vllm_proxy_completion_tokens_total",
        "vllm_proxy_key_requests_total",
        "vllm_proxy_key_rejected_total",
        "vllm_proxy_key_prompt_tokens_total",
        "vllm_proxy_key_completion_tokens_total",
    }
    wrappers = [v for v in vars(metrics).values() if isinstance(v, MetricWrapperBase)]
    assert len(wrappers) + len(request_path) == len(EXPORTED)
    for wrapper in wrappers:
        (family,) = wrapper.describe()
        name = family.name + "_total" if family.type == "counter" else family.name
        # .labels() takes exactly the metric's label names (ValueError otherwise)
        wrapper.labels(**dict.fromkeys(EXPORTED[name].labels, "x"))

    metrics.series("x").count("x")  # the request path's series, once a request was counted
    metrics.key_series("x").reject("x")  # ... and a key's, once one was refused
    rendered: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for sample in family.samples:
            rendered.setdefault(sample.name, set()).update(sample.labels)
    for name, series in EXPORTED.items():
        shown = name + "_bucket" if series.kind == "histogram" else name
        extra = {"le"} if series.kind == "histogram" else set()
        assert rendered.get(shown) == set(series.labels) | extra, f"{shown}: {rendered.get(shown)}"


def test_operations_doc_lists_exported_series() -> None:
    """docs/operations.md's metrics table names exactly the exported series."""
    text = (ROOT / "docs" / "operations.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith("| `vllm_")]
    documented = {name for row in rows for name in metric_names(row.split("|")[1])}
    assert documented == set(EXPORTED), (
        f"missing: {set(EXPORTED) - documented}, unknown: {documented - set(EXPORTED)}"
    )


# --- Prometheus -----------------------------------------------------------------------------


async def prom_query(http: aiohttp.ClientSession, base: str, query: str) -> list[dict[str, Any]]:
    async with http.get(base + "/api/v1/query", params={"query": query}) as resp:
        body: dict[str, Any] = await resp.json()
    assert body.get("status") == "success", f"{query}: {body}"
    result: list[dict[str, Any]] = body["data"]["result"]
    return result


def prometheus_config(target: str) -> str:
    return (
        "global:\n"
        "  scrape_interval: 1s\n"
        "  evaluation_interval: 1s\n"
        "scrape_configs:\n"
        f"  - job_name: {JOB}\n"
        "    scrape_interval: 1s\n"
        "    scrape_timeout: 1s\n"
        "    metrics_path: /metrics\n"
        "    static_configs:\n"
        f"      - targets: ['{target}']\n"
    )


async def test_prometheus_scrapes_metrics(start_proxy: StartProxy, tmp_path: Path) -> None:
    need(PROMETHEUS)
    base_config = make_config(tmp_path, models={"m1": {"model": "fake/m1", "memory_mb": 100}})
    data = base_config.model_dump(mode="json")
    data["gpu"] = {"monitor": "static", "devices": [{"id": 0, "memory_mb": 1000}]}
    proxy = await start_proxy(parse_config(data))
    async with await proxy.chat("m1") as resp:
        assert resp.status == 200, await resp.text()
        await resp.read()

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    config = tmp_path / "prometheus.yml"
    config.write_text(prometheus_config(f"127.0.0.1:{proxy.server.port}"))
    log = (tmp_path / "prometheus.log").open("wb")
    proc = await asyncio.create_subprocess_exec(
        PROMETHEUS,
        f"--config.file={config}",
        f"--storage.tsdb.path={tmp_path / 'tsdb'}",
        f"--web.listen-address=127.0.0.1:{port}",
        "--log.level=warn",
        stdout=log,
        stderr=log,
        start_new_session=True,
    )

    def log_tail() -> str:
        return (tmp_path / "prometheus.log").read_text(errors="replace")[-3000:]

    try:
        http = proxy.http

        async def ready() -> bool:
            assert proc.returncode is None, f"prometheus exited: {log_tail()}"
            return await healthy(http, base, "/-/ready")

        await wait_for(ready, timeout=30, what="prometheus ready")

        series: list[dict[str, Any]] = []

        async def scraped() -> bool:
            series[:] = await prom_query(http, base, "vllm_requests_total")
            return bool(series)

        await wait_for(scraped, timeout=30, what="vllm_requests_total in prometheus")
        labels = series[0]["metric"]
        assert labels["__name__"] == "vllm_requests_total"
        assert labels["model_id"] == "m1" and labels["status"] == "200", labels
        assert labels["job"] == JOB
        assert float(series[0]["value"][1]) >= 1

        up = await prom_query(http, base, f'up{{job="{JOB}"}}')
        assert [float(s["value"][1]) for s in up] == [1.0], up

        # The proxy's `instance` label (the engine instance) meets Prometheus's target label
        # of the same name: Prometheus keeps the target's and stores ours as exported_instance.
        # The dashboard's per-instance panels rely on that.
        states = await prom_query(http, base, "vllm_proxy_instance_state")
        assert [s["metric"] for s in states] == [
            {
                "__name__": "vllm_proxy_instance_state",
                "exported_instance": "m1#1",
                "instance": f"127.0.0.1:{proxy.server.port}",
                "job": JOB,
                "model_id": "m1",
                "state": "running",
            }
        ], states

        deadline = time.monotonic() + 30
        with_data: list[str] = []
        for expr in dashboard_exprs():
            query = expr
            for var, value in GRAFANA_VARS.items():
                query = query.replace(var, value)
            assert "$" not in query, f"unreplaced variable in {query}"
            result = await prom_query(http, base, query)
            assert time.monotonic() < deadline
            if re.search(r"\b(rate|increase|irate)\(", query):
                continue  # one scrape may be too few for a rate
            if not metric_names(query) <= PRESENT_AFTER_A_REQUEST:
                continue
            assert result, f"no data for a series the proxy exports: {query}"
            with_data.append(query)
            if "exported_instance" in query:
                assert {r["metric"].get("exported_instance") for r in result} == {"m1#1"}, (
                    query,
                    result,
                )
        print("\n".join(["dashboard queries with data:", *with_data]))
        assert len(with_data) >= 10, with_data
        assert sum("exported_instance" in q for q in with_data) >= 2, with_data
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        await proc.wait()
        log.close()
