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
from typing import Any

import aiohttp
import pytest
from conftest import StartProxy, free_port, make_config, wait_for

from vllm_proxy.config import EngineConfig, ServerConfig
from vllm_proxy.metrics import Metrics

ROOT = Path(__file__).resolve().parent.parent
UNIT = ROOT / "systemd" / "vllm-proxy.service"
DASHBOARD = ROOT / "docs" / "grafana-dashboard.json"
SYSTEMD_ANALYZE = "/usr/bin/systemd-analyze"
PROMETHEUS = "/usr/bin/prometheus"
JOB = "vllm-proxy"

#: The series the proxy exports, by type: what the dashboard may query.
EXPORTED: dict[str, str] = {
    "vllm_requests_total": "counter",
    "vllm_request_duration_seconds": "histogram",
    "vllm_time_to_first_byte_seconds": "histogram",
    "vllm_prompt_tokens_total": "counter",
    "vllm_completion_tokens_total": "counter",
    "vllm_model_loaded": "gauge",
    "vllm_model_requests_active": "gauge",
    "vllm_model_state": "gauge",
    "vllm_engine_start_duration_seconds": "histogram",
    "vllm_engine_restarts_total": "counter",
    "vllm_evictions_total": "counter",
    "vllm_admission_queue_depth": "gauge",
    "vllm_admission_wait_seconds": "histogram",
    "vllm_model_memory_estimate_mb": "gauge",
    "vllm_model_memory_measured_mb": "gauge",
    "vllm_gpu_memory_total_mb": "gauge",
    "vllm_gpu_memory_used_mb": "gauge",
    "vllm_gpu_utilization_percent": "gauge",
}
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")
#: Grafana's variables, replaced by what they mean for "all" when the query runs in Prometheus.
GRAFANA_VARS = {"$__rate_interval": "1m", "$__interval": "15s", "$instance": ".*", "$model": ".*"}


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
        if base != name and EXPORTED.get(base) == "histogram":
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
        "model state",
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
            kind = EXPORTED[base]
            if kind == "histogram":
                assert suffix, f"{name}: query a histogram through _bucket/_sum/_count"
            if kind == "counter" or suffix:
                assert re.search(rf"\b(rate|increase|irate)\(\s*{name}\b", expr), (
                    f"{name} is cumulative: query its rate or increase: {expr}"
                )
    assert used == set(EXPORTED), f"series without a panel: {set(EXPORTED) - used}"


def test_exported_series_match_the_registry() -> None:
    """The names the dashboard is checked against are what metrics.py registers."""
    families = {f.name: f.type for f in Metrics().registry.collect()}
    for name, kind in EXPORTED.items():
        family = name.removesuffix("_total") if kind == "counter" else name
        assert families.get(family) == kind, f"{name}: registry has {families.get(family)}"


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
    proxy = await start_proxy(make_config(tmp_path, models={"m1": {"model": "fake/m1"}}))
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
            try:
                async with http.get(base + "/-/ready") as r:
                    return r.status == 200
            except aiohttp.ClientConnectionError:
                return False

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

        deadline = time.monotonic() + 30
        for expr in dashboard_exprs():
            for var, value in GRAFANA_VARS.items():
                expr = expr.replace(var, value)
            assert "$" not in expr, f"unreplaced variable in {expr}"
            await prom_query(http, base, expr)
            assert time.monotonic() < deadline
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        await proc.wait()
        log.close()
