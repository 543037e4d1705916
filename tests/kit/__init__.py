"""The test kit: what the tests share, in one place.

* `fake` - `FakeEngine`, the fake engine's knobs as typed settings (`.env()` is the only place
  that writes the ``FAKE_ENGINE_*`` variables).
* `configs` - config builders: `make_config` (the fake engine, short timeouts, a private state
  dir), `config_data` (the same as a dict, for files and reloads), and the common shapes:
  `budget_config` (a static GPU budget), `sleep_config`, `replicas_config`, `sleepy`.
* `harness` - one proxy harness: `Proxies` starts in-process proxies from a `Config` or a file
  (`RunningProxy`), or the proxy as a process of its own (`ProxyProcess`).
* `chat` - chat and stream helpers (`chat_body`, `chat_text`, `sse_events`, `healthy`).
* `metrics` - one Prometheus scrape on ``prometheus_client.parser`` (`Samples`).
* `watch` - `Watch`, the invariant watcher (memory within budget, no engine cut under a lease).
* `raw` - `RawEngine`, a loopback server that answers with scripted bytes.
* `simgpu` - the simulated GPU: the ledger fixture's setup and `sim_config`.
* `gpumeasure` - the GPU check's readings of one engine (NVML, host memory, pinned memory).
* `wait` - polling with deadlines, processes and ports.
* `browser` - headless Chromium over its DevTools protocol (`chromium`, `Page`: navigate, click,
  type, run script, wait for the page, screenshot); imported by the browser tests themselves.
"""

from kit.chat import chat_body, chat_text, healthy, sse_events
from kit.configs import (
    FAKE_ENGINE,
    SLEEPY,
    budget_config,
    config_data,
    make_config,
    replicas_config,
    sleep_config,
    sleepy,
    static_gpu,
    write_config,
)
from kit.fake import FakeEngine
from kit.harness import Proxies, ProxyProcess, RunningProxy, StartProxy, wait_healthy
from kit.metrics import Samples, engine_samples, proxy_samples, scrape
from kit.raw import RawEngine
from kit.wait import (
    alive,
    free_port,
    group_alive,
    heap_probe,
    kill_group,
    wait_for,
    wait_for_sync,
)

__all__ = [
    "FAKE_ENGINE",
    "SLEEPY",
    "FakeEngine",
    "Proxies",
    "ProxyProcess",
    "RawEngine",
    "RunningProxy",
    "Samples",
    "StartProxy",
    "alive",
    "budget_config",
    "chat_body",
    "chat_text",
    "config_data",
    "engine_samples",
    "free_port",
    "group_alive",
    "healthy",
    "heap_probe",
    "kill_group",
    "make_config",
    "proxy_samples",
    "replicas_config",
    "scrape",
    "sleep_config",
    "sleepy",
    "sse_events",
    "static_gpu",
    "wait_for",
    "wait_for_sync",
    "wait_healthy",
    "write_config",
]
