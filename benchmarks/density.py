#!/usr/bin/env python3
"""How many models one GPU serves within a latency target: five policies on the same traffic,
in virtual time.

    .venv/bin/python benchmarks/density.py                  # 12 models, and a sweep over M
    .venv/bin/python benchmarks/density.py --docs           # also docs/benchmarks.md + the plot
    .venv/bin/python benchmarks/density.py --tune           # the scheduler's settings, a grid
    .venv/bin/python benchmarks/density.py --replay FILE    # an operator's own day

M models of the sizes in ``benchmarks/density_profile.yaml`` (the one file with every latency
and size figure, each with its source or marked as an estimate) share one GPU (an H100 80GB by
default). Each engine is cold, starting, awake, falling asleep, asleep, waking or stopping, for
the durations the profile gives; it holds its footprint on the GPU from the start of a start or
wake until it is asleep (then its residue) or stopped. A request is served when its model is
awake: its time to first token (TTFT) is its wait plus its prefill (prompt tokens / prefill
rate); the engine then holds a lease for it until its last token (output tokens / decode rate).

Traffic: each model's requests form a renewal process with gamma inter-arrival times (CV
``--cv``; 1 is Poisson, higher is burstier), at its share of ``--rate`` under a Zipf popularity
(``--zipf``); prompt and output tokens are lognormal. ``--replay`` reads a CSV
(``time,model,prompt_tokens,output_tokens``; time in seconds or ISO 8601) or the proxy's access
log (text or ``--log-format json``) instead.

The policies, side by side on the same requests:

* ``stop-on-swap`` (llama-swap): one model at a time; a request for another one waits in one
  FIFO until the current model's requests end, then it is stopped and the other cold-starts.
* ``sleep-on-swap`` (llmsnap): the same, but the current model is put to sleep (level 1) and a
  sleeping one is woken; sleepers keep their residue, and when the GPU is full the least
  recently used sleeper is stopped. Its sleeps obey the same host RAM as the proxy's
  (``--host-ram-gib``): an engine keeps its weights pinned from its first level-1 sleep until
  it stops, and where they do not fit in what is left a sleep falls back to level 2 (its wake
  reloads the weights), or to a stop where no level fits, as the proxy decides.
* ``swap-groups`` (llama-swap with ``groups``): the most requested models per GiB form one
  persistent group whose members stay resident together once started (``swap: false``), as
  long as the room left still holds the largest other model; the others form one swap group:
  one at a time in that room, in one FIFO, swapped by stop as ``stop-on-swap`` does. The
  run's grouping is printed under the tables.
* ``planner`` (the proxy before admission) and ``scheduler`` (the proxy as shipped) are not
  simulated by hand: they run the proxy's own ``Manager``, ``Model``, ``Instance``,
  ``Admission``, ``Memory`` (a static budget), admission queue and ``HostRam``, built from a
  parsed config so that the shipped defaults apply (idle timers, the level-2 fallback where
  host RAM is short, the device locks: starts and sleeps alone, wakes and stops beside each
  other); only the engine process is virtual
  and time jumps to the next timer (benchmarks/vproxy.py). The scheduler is ``Admission`` as
  it is; the planner is the same code with no measured prices (victims least recently used
  first), no holds, no turns (any waiting bring-up takes memory as soon as its plan fits) and
  no minimum residency. tests/bench/test_density_differential.py holds this engine model to the
  proxy on fake engines.

The one-model policies and the groups serve a request in order; with ``--give-up-s`` a request
that has waited that long is dropped when its turn comes (its client has hung up).

A bring-up of the planner or the scheduler that has not claimed memory within
``--queue-timeout-s`` (or the model's own ``queue_timeout_s``) answers its requests 503 (they
count as missed); the one-model policies queue until served or given up. Targets: every policy
is judged on the same TTFT targets (2, 5, 10, 30 and 60 s, and the share answered at all). The
headline "SLO attainment" column is the share of requests within one of them, ``--slo-s``
(10 s), whether the model was awake, asleep or cold when the request came (a target per kind
would favour policies that cold-start, whose requests then count as cold); the warm and cold
requests are also shown apart, against the same target. "Models per GPU" is the largest M of
the sweep whose attainment is at least 95 %. For the planner and the scheduler, a claim of GPU
memory by a model whose oldest request came more than the reorder window after the oldest one
of another waiting model is a reorder (it went ahead of that model); it is a *late overtake*
only when it took memory that model needed: once the claim has been carried out, that model's
plan (busy engines drained) cannot be placed, or waits for an engine busy now that it did not
wait for before (benchmarks/vproxy.py, ``ObservedAdmission._harmed``). The tables print late
overtakes with all reorders in brackets. Requests in the first ``--warmup-s`` are simulated
but not counted. The simulator checks that memory is never over-committed and that no engine
with a request in flight is put to sleep or stopped.

Prints the tables and the command that reproduced them; raw numbers go to
``benchmarks/results/density.json``; ``--docs`` writes the section of docs/benchmarks.md and
docs/benchmarks/density.svg.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import heapq
import json
import math
import os
import random
import re
import sys
import time
from collections import Counter, deque
from collections.abc import Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import docs_writer  # noqa: E402
import vproxy  # noqa: E402

from vllm_proxy.config import AdmissionConfig, EngineKeys, SleepPolicy  # noqa: E402
from vllm_proxy.planning.footprint import RUNTIME_POOL_MB  # noqa: E402
from vllm_proxy.planning.hostmem import HOST_RAM_MARGIN_MB  # noqa: E402

PROFILE = Path(__file__).resolve().parent / "density_profile.yaml"
RESULTS = ROOT / "benchmarks" / "results" / "density.json"
DOCS = docs_writer.DOCS
PLOT = ROOT / "docs" / "benchmarks" / "density.svg"
SECTION = "## Density: many models on one GPU"
POLICIES = ("stop-on-swap", "sleep-on-swap", "swap-groups", "planner", "scheduler")
#: The policies that run one model (or one group) at a time, without the proxy's admission.
SWAPPERS = ("stop-on-swap", "sleep-on-swap", "swap-groups")
MIB_PER_GIB = 1024
TARGET = 0.95
#: A sleep timer that never fires within a run (``--no-idle-timers``; the config has no "off").
NEVER_S = 10 * 365 * 86400.0
#: TTFT targets (seconds) every policy is judged on alike, whatever it did to the model.
SLO_TARGETS = (2.0, 5.0, 10.0, 30.0, 60.0)


# --------------------------------------------------------------------------- the profile


@dataclass(frozen=True)
class Size:
    """One model size class of the profile."""

    name: str
    params_b: float
    weights_gib: float
    footprint_gib: float
    residue_gib: float
    prefill_tok_s: float
    decode_tok_s: float
    #: GPUs one engine spans (tensor parallel); the footprint and residue are per GPU.
    tp: int = 1

    @property
    def footprint_mib(self) -> int:
        """What the engine holds awake on each of its GPUs."""
        return round(self.footprint_gib * MIB_PER_GIB)

    @property
    def residue_mib(self) -> int:
        """What the engine holds asleep on each of its GPUs."""
        return round(self.residue_gib * MIB_PER_GIB)

    @property
    def awake_mib(self) -> int:
        """What the engine holds awake on all its GPUs together."""
        return self.footprint_mib * self.tp

    @property
    def asleep_mib(self) -> int:
        """What the engine holds asleep on all its GPUs together."""
        return self.residue_mib * self.tp


@dataclass(frozen=True)
class Profile:
    """The GPU, the engine timings and the size classes (see density_profile.yaml)."""

    gpu_name: str
    total_mib: int
    reserve_mib: int
    timing: dict[str, float]
    sizes: dict[str, Size]
    mix: tuple[str, ...]
    models: dict[str, str] = field(default_factory=dict)
    #: GPUs of the host, each of `total_mib` with `reserve_mib` kept free.
    gpus: int = 1
    #: Named workloads (``--workload``): what each sets (see density_profile.yaml).
    workloads: dict[str, dict[str, Any]] = field(default_factory=dict)

    def start_s(self, s: Size) -> float:
        """A cold start: the fixed parts and the weights read at the disk rate (an older
        profile's ``start_base_s`` + ``start_s_per_gib`` x weights still reads)."""
        t = self.timing
        if "start_base_s" in t:
            return t["start_base_s"] + t["start_s_per_gib"] * s.weights_gib
        fixed = t["start_proc_s"] + t["compile_s"] + t["graphs_s"]
        return fixed + s.weights_gib / t["disk_gib_s"]

    def profile_s(self, s: Size) -> float:
        """From spawn to the end of vLLM's memory profiling: the set-up, the weights and the
        compiling profile run; the CUDA-graph capture follows (``v1/worker/gpu_worker.py``:
        ``determine_available_memory`` then ``compile_or_warm_up_model``). An older profile
        without the split: the whole start."""
        t = self.timing
        if "start_base_s" in t:
            return self.start_s(s)
        return t["start_proc_s"] + s.weights_gib / t["disk_gib_s"] + t["compile_s"]

    def wake_s(self, s: Size, level: int) -> float:
        t = self.timing
        # Each GPU copies its own share of the weights back, at once (tensor parallel).
        wake = t["wake_base_s"] + t["wake_s_per_gib"] * s.weights_gib / s.tp
        if level == 2:
            wake += t["reload_base_s"] + s.weights_gib / t["disk_gib_s"]
        return wake

    def sleep_s(self, s: Size, level: int, first: bool) -> float:
        t = self.timing
        if level == 2:
            return t["sleep_l2_s"]
        rate = t["first_sleep_s_per_gib"] if first else t["sleep_s_per_gib"]
        return t["sleep_base_s"] + rate * s.weights_gib / s.tp  # each GPU copies its share

    @property
    def stop_s(self) -> float:
        return self.timing["stop_s"]


def load_profile(path: Path, total_mib: int | None = None, gpus: int | None = None) -> Profile:
    raw = yaml.safe_load(path.read_text())
    sizes = {str(k): Size(name=str(k), **v) for k, v in raw["sizes"].items()}
    mix = tuple(str(m) for m in raw["mix"])
    workloads = {str(k): dict(v) for k, v in (raw.get("workloads") or {}).items()}
    named = [str(m) for w in workloads.values() for m in w.get("mix", [])]
    unknown = [m for m in [*mix, *(raw.get("models") or {}).values(), *named] if m not in sizes]
    if unknown:
        raise SystemExit(f"{path}: size(s) {unknown} are not under 'sizes'")
    gpu = raw["gpu"]
    return Profile(
        gpu_name=str(gpu["name"]),
        total_mib=int(total_mib if total_mib is not None else gpu["total_mib"]),
        reserve_mib=int(gpu["reserve_mib"]),
        timing={k: float(v) for k, v in raw["timing"].items()},
        sizes=sizes,
        mix=mix,
        models={str(k): str(v) for k, v in (raw.get("models") or {}).items()},
        gpus=int(gpus if gpus is not None else gpu.get("count", 1)),
        workloads=workloads,
    )


# --------------------------------------------------------------------------- traffic


@dataclass(frozen=True)
class Traffic:
    """How generated requests arrive (see the module docstring)."""

    rate: float = 0.2
    zipf: float = 1.0
    cv: float = 2.0
    seed: int = 1
    duration_s: float = 28800.0
    warmup_s: float = 600.0
    prompt_median: float = 400.0
    prompt_sigma: float = 1.0
    prompt_max: int = 16000
    output_median: float = 150.0
    output_sigma: float = 0.8
    output_max: int = 2048
    #: Independent runs (seeds `seed`, `seed` + 1, ...) counted together: one run's swaps
    #: and cold starts can tip a few points either way.
    seeds: int = 1


@dataclass(frozen=True)
class Client:
    """A closed-loop client: one model, the next request `think_s` after each answer."""

    model: int
    think_s: float = 0.0
    prompt: int = 400
    output: int = 150
    first_s: float = 0.0


@dataclass(frozen=True)
class Arrival:
    """One request of the workload: when, for which model (index), and its token counts."""

    time: float
    model: int
    prompt: int
    output: int


def zipf_shares(m: int, s: float) -> list[float]:
    """The popularity of models 1..m: proportional to 1 / rank**s."""
    w = [1.0 / (i + 1) ** s for i in range(m)]
    total = sum(w)
    return [x / total for x in w]


def lognormal(rng: random.Random, median: float, sigma: float, top: int) -> int:
    return max(1, min(top, round(median * math.exp(sigma * rng.gauss(0.0, 1.0)))))


def generate(m: int, t: Traffic) -> list[Arrival]:
    """`m` models' requests over warm-up plus duration, sorted by time. Each model has its own
    random stream (seeded by the seed and its index), so model i's arrivals only scale with its
    share when `m` changes."""
    end = t.warmup_s + t.duration_s
    shape = 1.0 / (t.cv * t.cv)
    out: list[Arrival] = []
    for i, share in enumerate(zipf_shares(m, t.zipf)):
        rng = random.Random(f"density-{t.seed}-{i}")
        mean = 1.0 / (t.rate * share)
        scale = mean / shape
        now = rng.gammavariate(shape, scale)
        while now < end:
            prompt = lognormal(rng, t.prompt_median, t.prompt_sigma, t.prompt_max)
            output = lognormal(rng, t.output_median, t.output_sigma, t.output_max)
            out.append(Arrival(now, i, prompt, output))
            now += rng.gammavariate(shape, scale)
    out.sort(key=lambda a: (a.time, a.model))
    return out


# --------------------------------------------------------------------------- replay

#: Fields of an access-log line (``key=value``), see proxy.py `_access`.
_FIELD = re.compile(r"(\w+)=(\S+)")
_TEXT_TIME = re.compile(r"(\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d(?:[,.]\d+)?)")
_ESCAPE = re.compile(r"\\(x[0-9a-fA-F]{2}|u[0-9a-fA-F]{4}|U[0-9a-fA-F]{8}|\\)")


def _unescape(text: str) -> str:
    """Undo the access log's escapes (``\\xNN``, ``\\uNNNN``, ``\\UNNNNNNNN``, ``\\\\``)."""

    def one(m: re.Match[str]) -> str:
        code = m.group(1)
        return "\\" if code == "\\" else chr(int(code[1:], 16))

    return _ESCAPE.sub(one, text)


def _seconds(text: str) -> float:
    """Seconds from a number or an ISO 8601 time (naive times are taken as UTC)."""
    try:
        return float(text)
    except ValueError:
        pass
    when = datetime.datetime.fromisoformat(text.strip().replace(",", ".").replace("Z", "+00:00"))
    if when.tzinfo is None:
        when = when.replace(tzinfo=datetime.UTC)
    return when.timestamp()


@dataclass(frozen=True)
class Record:
    """One request read from a replay file; token counts None when the file has none."""

    time: float
    model: str
    prompt: int | None
    output: int | None


def _int_or_none(text: str | None) -> int | None:
    if text is None or not text.strip():
        return None
    return int(float(text))


def parse_csv(lines: Iterable[str]) -> list[Record]:
    out = []
    for row in csv.DictReader(lines):
        if not row.get("model") or not row.get("time"):
            continue
        out.append(
            Record(
                _seconds(row["time"]),
                row["model"].strip(),
                _int_or_none(row.get("prompt_tokens")),
                _int_or_none(row.get("output_tokens") or row.get("completion_tokens")),
            )
        )
    return out


def parse_access_line(line: str) -> Record | None:
    """One line of the proxy's access log (logger ``vllm_proxy.access``), text or JSON, or None
    for any other line and for requests that never needed an engine (no model, or refused
    before it: 4xx other than 408, 429 and 499). The arrival is the log time less
    ``duration_ms`` (the line is written when the response ends)."""
    line = line.strip()
    if "vllm_proxy.access" not in line:
        return None
    when: float | None = None
    msg = line
    if line.startswith("{"):
        try:
            entry = json.loads(line)
        except ValueError:
            return None
        if entry.get("logger") != "vllm_proxy.access":
            return None
        msg = str(entry.get("msg", ""))
        if entry.get("ts"):
            when = _seconds(str(entry["ts"]))
    else:
        head, _, msg = line.partition("vllm_proxy.access:")
        stamp = _TEXT_TIME.search(head)
        if stamp:
            when = _seconds(stamp.group(1))
    fields = dict(_FIELD.findall(msg))
    model = _unescape(fields.get("model", "None"))
    if when is None or model in ("None", "-", ""):
        return None
    status = int(fields.get("status", "200"))
    if 400 <= status < 500 and status not in (408, 429, 499):
        return None
    when -= float(fields.get("duration_ms", "0")) / 1000
    prompt = _int_or_none(fields.get("prompt_tokens"))
    output = _int_or_none(fields.get("completion_tokens") or fields.get("output_tokens"))
    return Record(when, model, prompt, output)


def read_replay(path: Path) -> list[Record]:
    """Requests from a CSV (a header with ``time`` and ``model``) or an access log."""
    with path.open(newline="") as f:
        first = f.readline()
        f.seek(0)
        if "time" in first and "model" in first and "vllm_proxy.access" not in first:
            records = parse_csv(f)
        else:
            records = [r for r in map(parse_access_line, f) if r is not None]
    if not records:
        raise SystemExit(f"{path}: no requests found (a CSV with time,model,... or an access log)")
    return sorted(records, key=lambda r: r.time)


def replay_workload(
    records: Sequence[Record], prof: Profile, t: Traffic
) -> tuple[list[Arrival], list[str], list[Size]]:
    """Arrivals (time from the first request), model names (most requested first) and their
    sizes: the profile's ``models`` by name, else the mix in turn. Missing token counts are
    drawn from the traffic's distributions (seeded)."""
    counts: dict[str, int] = {}
    for r in records:
        counts[r.model] = counts.get(r.model, 0) + 1
    names = sorted(counts, key=lambda n: (-counts[n], n))
    index = {n: i for i, n in enumerate(names)}
    sizes, k = [], 0
    for n in names:
        if n in prof.models:
            sizes.append(prof.sizes[prof.models[n]])
        else:
            sizes.append(prof.sizes[prof.mix[k % len(prof.mix)]])
            k += 1
    rng = random.Random(f"density-replay-{t.seed}")
    start = records[0].time
    out = []
    for r in records:
        prompt = r.prompt or lognormal(rng, t.prompt_median, t.prompt_sigma, t.prompt_max)
        output = r.output or lognormal(rng, t.output_median, t.output_sigma, t.output_max)
        out.append(Arrival(r.time - start, index[r.model], prompt, output))
    return out, names, sizes


# --------------------------------------------------------------------------- the engines

COLD, STARTING, AWAKE, FALLING, ASLEEP, WAKING, STOPPING = (
    "cold", "starting", "awake", "falling-asleep", "asleep", "waking", "stopping",
)  # fmt: skip
#: States in which a model has a process (its requests count as warm).
WARM = frozenset({AWAKE, FALLING, ASLEEP, WAKING})
ARRIVE, LEASE_END, DONE, TICK = 0, 1, 2, 3


class Req:
    """One request in the simulation and what happened to it."""

    __slots__ = ("admit", "client", "cold", "failed", "gave_up", "id", "model", "output",
                 "overtaken", "prompt", "time", "ttft")  # fmt: skip

    def __init__(self, i: int, a: Arrival) -> None:
        self.id = i
        self.time = a.time
        self.model = a.model
        self.prompt = a.prompt
        self.output = a.output
        self.admit: float | None = None
        self.ttft: float | None = None
        self.cold = False
        #: When it was answered 503 (its bring-up found no memory within the queue timeout).
        self.failed: float | None = None
        #: When a request that came more than max_reorder_s later went ahead of it.
        self.overtaken: float | None = None
        #: Its client hung up before it was served (``--give-up-s``).
        self.gave_up = False
        #: The closed-loop client that sent it (None: open-loop traffic).
        self.client: int | None = None


class Engine:
    """One model's engine: its state, the memory it holds and the requests that wait for it."""

    def __init__(self, idx: int, name: str, size: Size) -> None:
        self.idx = idx
        self.name = name
        self.size = size
        self.state = COLD
        self.held = 0  # MiB on the GPU now
        self.leases = 0  # requests in flight
        self.last_used = -math.inf
        self.resident_since = 0.0
        self.began = 0.0  # start of the current transition
        self.token = 0  # bumped by every transition: a stale DONE event is ignored
        #: A bring-up is planned: it begins once `need` MiB are free (its victims are leaving).
        self.committed = False
        self.need = 0
        #: When the bring-up now waiting for memory began to wait (its queue time-out runs
        #: from then).
        self.attempt = 0.0
        self.waiting: deque[Req] = deque()  # for a bring-up (or riding on one)
        self.held_reqs: deque[Req] = deque()  # for this awake engine, held behind a waiter
        self.slept = False  # it has been put to sleep at level 1 before: pinned buffers exist
        self.level = 1  # the level of its sleep now (or its last one)
        self.start_s: float | None = None
        self.wake_s: float | None = None
        self.start_mean: float | None = None
        self.wake_mean: float | None = None


def shipped(keys: Any, name: str) -> float:
    """A setting's shipped default (vllm_proxy/config.py), so that the scheduler runs as users
    get it when the defaults change."""
    return float(keys.model_fields[name].default)


@dataclass
class Settings:
    """What every policy shares in one run, and the scheduler's own settings."""

    #: The one TTFT target of the headline column and of models per GPU (every request).
    slo_s: float = 10.0
    sleep_level: int = 1
    max_reorder_s: float = shipped(AdmissionConfig, "max_reorder_s")
    min_resident_s: float = shipped(EngineKeys, "min_resident_s")
    idle_grace_s: float = shipped(AdmissionConfig, "idle_grace_s")
    #: Caps the reorder window at half of it, and a hold at all of it (the sim has no other
    #: time-outs: a request waits until served).
    queue_timeout_s: float = shipped(AdmissionConfig, "queue_timeout_s")
    #: A client hangs up after waiting this long for its first token (None: never).
    give_up_s: float | None = None
    #: Host RAM for level-1 sleeps (the proxy falls back to level 2 where it is short).
    host_ram_gib: float = 1024.0
    #: The shipped idle timers (engine.idle_timeout_s, sleep.after_idle_s) run.
    idle_timers: bool = True
    #: ``idle_timeout_s`` for every model (None: the shipped default; 0: an idle engine, awake
    #: or asleep, is stopped only when its memory is needed).
    idle_timeout_s: float | None = None
    #: Scheduler rules left out (vproxy.ABLATIONS: holds, prices, spare), to measure each.
    without: tuple[str, ...] = ()
    #: ``sleep.on_idle``: needed (the shipped default: an idle engine sleeps only if another
    #: model may want its memory) or always.
    on_idle: str = str(SleepPolicy.model_fields["on_idle"].default)


@dataclass
class Result:
    """One policy's run: every counted request's outcome and the run's counters."""

    policy: str
    models: list[str]
    sizes: list[str]
    measured_s: float
    generated: int = 0
    served: int = 0
    timed_out: int = 0
    #: Requests whose client hung up first (``--give-up-s``).
    gave_up: int = 0
    unserved: int = 0
    counted: int = 0
    ttft: list[float] = field(default_factory=list)
    ok: list[bool] = field(default_factory=list)
    cold: list[bool] = field(default_factory=list)
    model_of: list[int] = field(default_factory=list)
    swaps: int = 0
    cold_starts: int = 0
    wakes: int = 0
    #: Engines put to sleep and stopped (for memory or by the idle timers), and level-1 sleeps
    #: that host RAM turned into level-2 ones (or into stops).
    sleeps: int = 0
    stops: int = 0
    fallbacks: int = 0
    #: The most host RAM pinned by sleeping engines at once (MiB).
    max_pinned_mib: int = 0
    start_gpu_s: float = 0.0
    wake_gpu_s: float = 0.0
    late_overtakes: int = 0
    reorders: int = 0
    #: swap-groups: the models of the resident group.
    resident: list[str] = field(default_factory=list)
    max_beyond_turn_s: float = 0.0
    max_used_mib: int = 0
    over_commits: int = 0
    busy_evictions: int = 0

    def summary(self) -> dict[str, Any]:
        n = len(self.ttft)
        minutes = self.measured_s / 60
        return {
            "policy": self.policy,
            "requests": n,
            "served_counted": sum(1 for x in self.ttft if not math.isinf(x)),
            "served": self.served,
            "timed_out": self.timed_out,
            "gave_up": self.gave_up,
            "unserved": self.unserved,
            "attainment": sum(self.ok) / n if n else float("nan"),
            "at_target": {t: k / n if n else float("nan") for t, k in self.within().items()},
            "answered": _share([not math.isinf(x) for x in self.ttft]),
            "attainment_warm": _share([o for o, c in self._ok_cold() if not c]),
            "attainment_cold": _share([o for o, c in self._ok_cold() if c]),
            "cold_requests": sum(self.cold),
            "ttft_p50": pct(self.ttft, 50),
            "ttft_p99": pct(self.ttft, 99),
            "swaps_per_min": self.swaps / minutes,
            "cold_starts_per_min": self.cold_starts / minutes,
            "wakes_per_min": self.wakes / minutes,
            "start_gpu_s": self.start_gpu_s,
            "wake_gpu_s": self.wake_gpu_s,
            "late_overtakes": self.late_overtakes,
            "reorders": self.reorders,
            "resident": self.resident,
            "max_beyond_turn_s": self.max_beyond_turn_s,
            "max_used_mib": self.max_used_mib,
            "over_commits": self.over_commits,
            "busy_evictions": self.busy_evictions,
            "sleeps": self.sleeps,
            "stops": self.stops,
            "fallbacks": self.fallbacks,
            "max_pinned_mib": self.max_pinned_mib,
        }

    def within(self) -> dict[str, int]:
        """How many requests had their first token within each of `SLO_TARGETS`."""
        return {f"{t:g}": sum(x <= t for x in self.ttft) for t in SLO_TARGETS}

    def _ok_cold(self) -> list[tuple[bool, bool]]:
        return list(zip(self.ok, self.cold, strict=True))

    def per_model(self) -> list[dict[str, Any]]:
        rows = []
        for i, name in enumerate(self.models):
            t = [x for x, m in zip(self.ttft, self.model_of, strict=True) if m == i]
            ok = [x for x, m in zip(self.ok, self.model_of, strict=True) if m == i]
            rows.append({"model": name, "size": self.sizes[i], "requests": len(t),
                         "attainment": _share(ok), "ttft_p50": pct(t, 50),
                         "ttft_p99": pct(t, 99)})  # fmt: skip
        return rows


def _share(flags: Sequence[bool]) -> float:
    return sum(flags) / len(flags) if flags else float("nan")


def pct(xs: Sequence[float], q: float) -> float:
    """The q-th percentile (linear between closest ranks); NaN for no data."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    k = (len(s) - 1) * q / 100
    lo = math.floor(k)
    hi = min(lo + 1, len(s) - 1)
    if math.isinf(s[hi]) and (k > lo or math.isinf(s[lo])):
        return math.inf  # requests never served (timed out) count as infinitely late
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


# --------------------------------------------------------------------------- the simulator


class Sim:
    """The event loop, the engines' transitions and the checks every policy shares."""

    policy = ""

    def __init__(
        self,
        arrivals: Sequence[Arrival],
        names: Sequence[str],
        sizes: Sequence[Size],
        prof: Profile,
        st: Settings,
        warmup_s: float,
        measured_s: float,
        clients: Sequence[Client] = (),
    ) -> None:
        self.prof = prof
        self.clients = list(clients)
        self.st = st
        self.engines = [Engine(i, n, s) for i, (n, s) in enumerate(zip(names, sizes, strict=True))]
        self.by_name = {e.name: e for e in self.engines}
        self.reqs = [Req(i, a) for i, a in enumerate(arrivals)]
        self.warmup = warmup_s
        self.end = warmup_s + measured_s
        self.res = Result(self.policy, list(names), [s.name for s in sizes], measured_s)
        self.events: list[tuple[float, int, int, Any]] = []
        self.seq = 0
        self.now = 0.0
        # The one-model policies and the groups see the host's GPUs as one pool (an engine that
        # spans several GPUs takes its share on each): no bin packing, in their favour.
        self.cap = (prof.total_mib - prof.reserve_mib) * prof.gpus
        self.used = 0
        #: Host RAM for sleeps, and what each engine keeps pinned there (from its first level-1
        #: sleep until it stops: PyTorch keeps the pinned blocks cached), as in the proxy
        #: (vllm_proxy/planning/hostmem.py) and its virtual engines (benchmarks/vproxy.py).
        self.host_mib = round(st.host_ram_gib * MIB_PER_GIB)
        self.pinned: dict[int, int] = {}
        #: What a sleep of a model at a level was seen to pin (the proxy learns it likewise).
        self.learned: dict[tuple[str, int], int] = {}

    # -- the loop

    def push(self, t: float, kind: int, obj: Any) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, obj))

    def run(self) -> Result:
        for r in self.reqs:
            self.push(r.time, ARRIVE, r)
        for k, c in enumerate(self.clients):
            self.send(k, c.first_s)
        while self.events:
            t, _, kind, obj = heapq.heappop(self.events)
            self.now = t
            if kind == ARRIVE:
                e = self.engines[obj.model]
                obj.cold = e.state not in WARM
                self.arrive(obj, e)
            elif kind == LEASE_END:
                e, r = obj
                e.leases -= 1
                e.last_used = t
                self.answered(r)
            elif kind == DONE:
                e, token = obj
                if token != e.token:
                    continue
                self.done(e)
            self.decide()
        return self.finish()

    def finish(self) -> Result:
        res = self.res
        res.generated = len(self.reqs)
        for r in self.reqs:
            if r.admit is not None:
                res.served += 1
            elif r.failed is not None:
                res.timed_out += 1
            elif r.gave_up:
                res.gave_up += 1
            else:
                res.unserved += 1
            if not self.warmup <= r.time < self.end:
                continue
            e = self.engines[r.model]
            ttft = math.inf if r.ttft is None else r.ttft
            res.ttft.append(ttft)
            res.cold.append(r.cold)
            res.ok.append(ttft <= self.st.slo_s)
            res.model_of.append(e.idx)
            if r.overtaken is not None:
                res.late_overtakes += 1
                end = r.admit if r.admit is not None else r.failed
                beyond = (end if end is not None else self.now) - r.overtaken
                res.max_beyond_turn_s = max(res.max_beyond_turn_s, beyond)
        return res

    # -- what every policy decides

    def arrive(self, r: Req, e: Engine) -> None:
        raise NotImplementedError

    def decide(self) -> None:
        raise NotImplementedError

    def awake(self, e: Engine) -> None:
        """`e` is up: serve what waited for it."""
        while e.waiting:
            self.admit(e.waiting.popleft(), e)

    # -- requests

    def admit(self, r: Req, e: Engine) -> None:
        assert e.state == AWAKE, (self.policy, e.name, e.state)
        prefill = r.prompt / e.size.prefill_tok_s
        r.admit = self.now
        r.ttft = self.now - r.time + prefill
        e.leases += 1
        e.last_used = self.now
        self.push(self.now + prefill + r.output / e.size.decode_tok_s, LEASE_END, (e, r))

    # -- closed-loop clients

    def send(self, k: int, at: float) -> None:
        """Client `k`'s next request, at `at` (none past the end of the run)."""
        if at >= self.end:
            return
        c = self.clients[k]
        r = Req(len(self.reqs), Arrival(at, c.model, c.prompt, c.output))
        r.client = k
        self.reqs.append(r)
        self.push(at, ARRIVE, r)

    def gave_up(self, r: Req) -> bool:
        """Whether `r`'s client hung up before it was served (``--give-up-s``): it is not
        served, and its client sends the next one."""
        if self.st.give_up_s is None or self.now - r.time <= self.st.give_up_s:
            return False
        r.gave_up = True
        self.answered(r)
        return True

    def answered(self, r: Req) -> None:
        """`r` has its whole answer (or its error): its client sends the next one."""
        if r.client is not None:
            self.send(r.client, self.now + self.clients[r.client].think_s)

    # -- transitions

    def _counted(self) -> bool:
        return self.warmup <= self.now < self.end

    def _begin(self, e: Engine, state: str, seconds: float) -> None:
        e.state = state
        e.began = self.now
        e.token += 1
        self.push(self.now + seconds, DONE, (e, e.token))

    def _take(self, e: Engine, mib: int) -> None:
        self.used += mib - e.held
        e.held = mib
        self.res.max_used_mib = max(self.res.max_used_mib, self.used)
        if self.used > self.cap:
            self.res.over_commits += 1

    def free(self) -> int:
        return self.cap - self.used

    def start(self, e: Engine) -> None:
        assert e.state == COLD
        e.committed = False
        self._take(e, e.size.awake_mib)
        seconds = self.prof.start_s(e.size)
        self._begin(e, STARTING, seconds)
        if self._counted():
            self.res.cold_starts += 1
            self.res.start_gpu_s += seconds

    def wake(self, e: Engine) -> None:
        assert e.state == ASLEEP
        e.committed = False
        self._take(e, e.size.awake_mib)
        seconds = self.prof.wake_s(e.size, e.level)
        self._begin(e, WAKING, seconds)
        if self._counted():
            self.res.wakes += 1
            self.res.wake_gpu_s += seconds

    def sleep(self, e: Engine) -> None:
        """Put `e` to sleep at the level host RAM allows, as the proxy does
        (`Instance._choose_level`): level 1 falls back to level 2 where the weights do not fit
        in what is left, and with no level fitting the engine is stopped instead."""
        assert e.state == AWAKE
        level = self.sleep_level(e)
        if level != self.st.sleep_level and self._counted():
            self.res.fallbacks += 1
        if level is None:
            self.stop(e)
            return
        self._evicting(e)
        seconds = self.prof.sleep_s(e.size, level, first=not e.slept)
        e.level = level
        if level == 1:
            e.slept = True
            weights = round(e.size.weights_gib * MIB_PER_GIB)
            self.pinned[e.idx] = max(self.pinned.get(e.idx, 0), weights)
            self.learned[(e.name, 1)] = self.pinned[e.idx]
            self.res.max_pinned_mib = max(self.res.max_pinned_mib, sum(self.pinned.values()))
        elif not self.pinned.get(e.idx):  # a first sleep at level 2 pins the runtime pool,
            self.learned[(e.name, 2)] = 0  # which neither these engines nor vproxy's model
        if self._counted():
            self.res.sleeps += 1
        self._begin(e, FALLING, seconds)

    def sleep_level(self, e: Engine) -> int | None:
        """The level `e`'s sleep takes (None: none fits, it is stopped): what it would pin
        beyond what it keeps pinned (learned, else the proxy's guess: the weights and the
        runtime pool, or the runtime pool alone), with the proxy's margin, within host RAM."""
        weights = round(e.size.weights_gib * MIB_PER_GIB)
        guesses = {1: weights + RUNTIME_POOL_MB, 2: RUNTIME_POOL_MB}
        room = self.host_mib - sum(self.pinned.values())
        levels = [1, 2] if self.st.sleep_level == 1 else [self.st.sleep_level]
        for level in levels:
            expected = self.learned.get((e.name, level), guesses[level])
            need = max(expected - self.pinned.get(e.idx, 0), 0)
            if not need or need + HOST_RAM_MARGIN_MB <= room:
                return level
        return None

    def stop(self, e: Engine) -> None:
        assert e.state in (AWAKE, ASLEEP), e.state
        self._evicting(e)
        if self._counted():
            self.res.stops += 1
        self._begin(e, STOPPING, self.prof.stop_s)

    def _evicting(self, e: Engine) -> None:
        if e.leases:
            self.res.busy_evictions += 1
        # Requests held for it now wait for its next bring-up, in their order.
        if e.held_reqs:
            e.attempt = self.now
        while e.held_reqs:
            e.waiting.appendleft(e.held_reqs.pop())

    def done(self, e: Engine) -> None:
        took = self.now - e.began
        if e.state in (STARTING, WAKING):
            if e.state == STARTING:
                e.start_s = took
            else:
                e.wake_s = took
            e.state = AWAKE
            e.resident_since = self.now
            e.last_used = self.now
            self.awake(e)
        elif e.state == FALLING:
            e.state = ASLEEP
            self._take(e, e.size.asleep_mib)
        elif e.state == STOPPING:
            e.state = COLD
            e.slept = False
            self.pinned.pop(e.idx, None)
            self._take(e, 0)


class SwapSim(Sim):
    """One model at a time, one FIFO (llama-swap with ``stop``, llmsnap with ``sleep``)."""

    def __init__(self, mode: str, *args: Any) -> None:
        self.policy = f"{mode}-on-swap"
        super().__init__(*args)
        self.mode = mode
        self.queue: deque[Req] = deque()
        self.current: Engine | None = None  # the one awake (or coming up) model
        self.target: Engine | None = None  # the model a swap in progress brings up

    def arrive(self, r: Req, e: Engine) -> None:
        self.queue.append(r)

    def awake(self, e: Engine) -> None:
        pass  # the queue is served in order by decide()

    def decide(self) -> None:
        self.advance()
        while self.queue:
            head = self.queue[0]
            if self.gave_up(head):
                self.queue.popleft()
                continue
            e = self.engines[head.model]
            if self.target is None and e is self.current and e.state == AWAKE:
                self.admit(self.queue.popleft(), e)
                continue
            if self.target is not None:
                return
            cur = self.current
            if cur is not None:
                if cur.leases:
                    return  # the swap waits for the current model's requests to end
                if self.mode == "stop":
                    self.stop(cur)
                else:
                    self.sleep(cur)
                if self._counted():
                    self.res.swaps += 1
            self.target = e
            self.advance()
            return

    def advance(self) -> None:
        """Move a swap in progress on: once the old model is gone, make room and bring up
        the new one."""
        t = self.target
        if t is None:
            return
        cur = self.current
        if cur is not None and cur is not t:
            if cur.state in (FALLING, STOPPING):
                return
            self.current = None
        if t.state in (STARTING, WAKING):
            return
        if t.state == AWAKE:
            self.current, self.target = t, None
            return
        if t.state in (FALLING, STOPPING):
            return
        need = t.size.awake_mib - t.held
        if self.free() < need:
            if any(e.state == STOPPING for e in self.engines):
                return
            sleepers = sorted((e for e in self.engines if e.state == ASLEEP and e is not t),
                              key=lambda e: (e.last_used, e.idx))  # fmt: skip
            room = self.free()
            for e in sleepers:
                if room >= need:
                    break
                room += e.held
                self.stop(e)
            return
        self.current = t
        if t.state == ASLEEP:
            self.wake(t)
        else:
            self.start(t)


class GroupSim(SwapSim):
    """llama-swap with groups: a persistent group of models resident together, and a swap group
    whose members take turns, by stop, in the room the first leaves (see the module
    docstring)."""

    def __init__(self, *args: Any) -> None:
        super().__init__("stop", *args)
        self.policy = self.res.policy = "swap-groups"
        self.resident = resident_group(self.engines, self.reqs, self.clients, self.cap)
        self.res.resident = [e.name for e in self.engines if e.idx in self.resident]

    def arrive(self, r: Req, e: Engine) -> None:
        if e.idx not in self.resident:
            super().arrive(r, e)
            return
        e.waiting.append(r)
        if e.state == COLD:
            self.start(e)  # its room is kept: the group fits beside any other model
        elif e.state == AWAKE:
            self.awake(e)

    def awake(self, e: Engine) -> None:
        if e.idx not in self.resident:
            return  # the swap group's FIFO is served by decide()
        while e.waiting:
            r = e.waiting.popleft()
            if not self.gave_up(r):
                self.admit(r, e)


def resident_group(
    engines: Sequence[Engine], reqs: Sequence[Req], clients: Sequence[Client], cap: int
) -> set[int]:
    """The persistent group: models by requests per GiB awake, most first, while the group and
    the largest model left out still fit together (by index)."""
    count = Counter(r.model for r in reqs) + Counter(c.model for c in clients)
    order = sorted(engines, key=lambda e: (-count[e.idx] / e.size.awake_mib, e.idx))
    group: set[int] = set()
    used = 0
    for e in order:
        rest = [o.size.awake_mib for o in engines if o.idx not in group and o is not e]
        if used + e.size.awake_mib + max(rest, default=0) > cap:
            continue
        group.add(e.idx)
        used += e.size.awake_mib
    return group


def simulate(
    policy: str,
    arrivals: Sequence[Arrival],
    names: Sequence[str],
    sizes: Sequence[Size],
    prof: Profile,
    st: Settings,
    warmup_s: float,
    measured_s: float,
    clients: Sequence[Client] = (),
) -> Result:
    args = (arrivals, names, sizes, prof, st, warmup_s, measured_s, clients)
    if policy in ("stop-on-swap", "sleep-on-swap"):
        return SwapSim(policy.split("-")[0], *args).run()
    if policy == "swap-groups":
        return GroupSim(*args).run()
    if policy in ("planner", "scheduler"):
        return proxy_run(policy == "scheduler", *args)
    raise ValueError(f"unknown policy {policy!r}")


def proxy_run(
    scheduler: bool,
    arrivals: Sequence[Arrival],
    names: Sequence[str],
    sizes: Sequence[Size],
    prof: Profile,
    st: Settings,
    warmup_s: float,
    measured_s: float,
    clients: Sequence[Client] = (),
) -> Result:
    """The planner or the scheduler: the proxy's own `Manager` and `Admission` in virtual
    time (`vproxy`), with the engines' times from the profile."""
    end = warmup_s + measured_s
    timing = {}
    models: dict[str, dict[str, Any]] = {}
    for n, s in zip(names, sizes, strict=True):
        timing[n] = vproxy.Timing(
            start_s=prof.start_s(s), stop_s=prof.stop_s,
            wake_s=lambda level, s=s: prof.wake_s(s, level),  # type: ignore[misc]
            sleep_s=lambda level, first, s=s: prof.sleep_s(s, level, first),  # type: ignore[misc]
            weights_mib=round(s.weights_gib * MIB_PER_GIB),
            footprint_mib=s.footprint_mib, residue_mib=s.residue_mib,
            profile_s=prof.profile_s(s),
        )  # fmt: skip
        models[n] = {"model": "x", "memory_mb": s.footprint_mib, "params_b": s.params_b,
                     "sleep": {"level": st.sleep_level, "memory_mb": s.residue_mib,
                               "verify_wake": False, "on_idle": st.on_idle}}  # fmt: skip
        if s.tp > 1:
            models[n]["args"] = {"tensor_parallel_size": s.tp}
        if st.idle_timeout_s is not None:
            models[n]["idle_timeout_s"] = st.idle_timeout_s
        if not st.idle_timers:  # no timer at all (0 would put idle engines to sleep at once)
            models[n]["idle_timeout_s"] = 0
            models[n]["sleep"]["after_idle_s"] = NEVER_S
    world = vproxy.World(timing, round(st.host_ram_gib * MIB_PER_GIB),
                         capacity_mib=prof.total_mib - prof.reserve_mib)  # fmt: skip
    engine = {"min_resident_s": st.min_resident_s if scheduler else 0.0}
    admission = {"queue_timeout_s": st.queue_timeout_s, "max_reorder_s": st.max_reorder_s,
                 "idle_grace_s": st.idle_grace_s}  # fmt: skip
    cfg = vproxy.config(models, prof.total_mib, prof.reserve_mib, vproxy.state_dir(),
                        admission, engine, gpus=prof.gpus)  # fmt: skip
    # The profile's footprints and residues already hold the context (and NCCL's buffers).
    cfg = cfg.model_copy(update={"gpu": cfg.gpu.model_copy(update={"context_mb": 0, "nccl_mb": 0})})

    def request(a: Arrival, client: int | None = None) -> vproxy.Request:
        s = sizes[a.model]
        return vproxy.Request(a.time, names[a.model], a.prompt / s.prefill_tok_s,
                              a.output / s.decode_tok_s, client)  # fmt: skip

    def next_of(k: int, now: float) -> vproxy.Request | None:
        c = clients[k]
        return request(Arrival(now + c.think_s, c.model, c.prompt, c.output), k)

    first = [request(Arrival(c.first_s, c.model, c.prompt, c.output), k)
             for k, c in enumerate(clients)]  # fmt: skip
    outcomes = vproxy.run(
        cfg, world, [*(request(a) for a in arrivals), *first], planner=not scheduler,
        without=frozenset(st.without) if scheduler else frozenset(),
        count=lambda t: warmup_s <= t < end, give_up_s=st.give_up_s, until=end,
        client_requests=next_of,
    )  # fmt: skip
    res = Result("scheduler" if scheduler else "planner", list(names),
                 [s.name for s in sizes], measured_s)  # fmt: skip
    res.generated = len(outcomes)
    index = {n: i for i, n in enumerate(names)}
    for o in sorted(outcomes, key=lambda o: o.request.time):
        if o.failed:
            res.timed_out += 1
        elif o.gave_up:
            res.gave_up += 1
        else:
            res.served += 1
        if not warmup_s <= o.request.time < end:
            continue
        res.ttft.append(o.ttft)
        res.cold.append(o.cold)
        res.ok.append(o.ttft <= st.slo_s)
        res.model_of.append(index[o.request.model])
    for key in (
        "swaps",
        "cold_starts",
        "wakes",
        "start_gpu_s",
        "wake_gpu_s",
        "late_overtakes",
        "reorders",
        "sleeps",
        "stops",
        "fallbacks",
        "max_pinned_mib",
        "max_used_mib",
        "over_commits",
        "busy_evictions",
    ):
        setattr(res, key, getattr(world, key))
    return res


def workload(m: int, prof: Profile, t: Traffic) -> tuple[list[Arrival], list[str], list[Size]]:
    sizes = [prof.sizes[prof.mix[i % len(prof.mix)]] for i in range(m)]
    names = [f"m{i + 1:02d}-{s.name}" for i, s in enumerate(sizes)]
    return generate(m, t), names, sizes


def run_one(job: tuple[str, int, Profile, Traffic, Settings]) -> dict[str, Any]:
    """One policy on the generated workload of `m` models (a process-pool job)."""
    policy, m, prof, t, st = job
    runs = []
    for k in range(t.seeds):
        arrivals, names, sizes = workload(m, prof, replace(t, seed=t.seed + k))
        runs.append(simulate(policy, arrivals, names, sizes, prof, st, t.warmup_s, t.duration_s))
    res = merged(runs)
    out = res.summary()
    # Each seed's own count per target: the runs of two policies on one seed saw the same
    # requests, so `standing` can pair them (see `behind`).
    out["by_seed"] = [{"requests": len(r.ttft), "hits": r.within()} for r in runs]
    out["m"] = m
    out["generated"] = res.generated
    out["per_model"] = res.per_model()
    return out


def _seeds(t: Traffic) -> str:
    if t.seeds == 1:
        return f"seed {t.seed}"
    return f"seeds {t.seed}-{t.seed + t.seeds - 1} counted together"


def merged(runs: Sequence[Result]) -> Result:
    """Several runs of one policy (one per seed) as one: their requests together, their
    counters summed over their summed time, the largest of their maxima."""
    out = replace(runs[0], ttft=[], ok=[], cold=[], model_of=[])
    for r in runs:
        for name in ("ttft", "ok", "cold", "model_of"):
            getattr(out, name).extend(getattr(r, name))
    for name in ("measured_s", "generated", "served", "timed_out", "gave_up", "unserved",
                 "counted", "swaps", "cold_starts", "wakes", "start_gpu_s", "wake_gpu_s",
                 "late_overtakes", "reorders", "over_commits", "busy_evictions", "sleeps",
                 "stops", "fallbacks"):  # fmt: skip
        setattr(out, name, sum(getattr(r, name) for r in runs))
    out.max_beyond_turn_s = max(r.max_beyond_turn_s for r in runs)
    out.max_pinned_mib = max(r.max_pinned_mib for r in runs)
    out.max_used_mib = max(r.max_used_mib for r in runs)
    return out


def run_jobs(jobs: list[Any], workers: int, fn: Any = run_one) -> list[dict[str, Any]]:
    if workers <= 1 or len(jobs) == 1:
        return [fn(j) for j in jobs]
    with ProcessPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(fn, jobs, chunksize=1))


# --------------------------------------------------------------------------- tables


def f(x: float, d: int = 1) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    if math.isinf(x):
        return "inf"
    return f"{x:,.{d}f}"


def pc(x: float, d: int = 1) -> str:
    return "-" if x is None or math.isnan(x) else f"{100 * x:.{d}f} %"


def targets_table(rows: Sequence[dict[str, Any]]) -> list[str]:
    """Each policy's share of requests with a TTFT within each target (one SLO for all)."""
    heads = " | ".join(f"<= {t:g} s" for t in SLO_TARGETS)
    out = [f"| policy | {heads} | answered at all |",
           "|---|" + "---:|" * (len(SLO_TARGETS) + 1)]  # fmt: skip
    for r in rows:
        cells = " | ".join(pc(r["at_target"][f"{t:g}"]) for t in SLO_TARGETS)
        out.append(f"| {r['policy']} | {cells} | {pc(r['answered'])} |")
    return out


def alt_table(jobs: Sequence[Any], rows: Sequence[dict[str, Any]],
              main_rows: Sequence[dict[str, Any]],
              by_rate: dict[float, list[dict[str, Any]]]) -> list[str]:  # fmt: skip
    """Each target at each rate: the variant's planner and scheduler beside sleep-on-swap
    (as shipped) where it ran."""
    heads = " | ".join(f"<= {t:g} s" for t in SLO_TARGETS)
    out = [f"| requests/s | policy | {heads} | answered at all | cold starts / min |",
           "|---:|---|" + "---:|" * (len(SLO_TARGETS) + 2)]  # fmt: skip
    for r, j in zip(rows, jobs, strict=True):
        rate = j[3].rate
        base = {b["policy"]: b for b in by_rate.get(rate, main_rows)}
        for shown in ([base["sleep-on-swap"]] if "sleep-on-swap" in base and
                      j[0] == "planner" else []) + [r]:  # fmt: skip
            name = (
                shown["policy"]
                if shown is not r
                else f"{r['policy']}, idle_timeout_s {j[4].idle_timeout_s:g}"
            )
            cells = " | ".join(pc(shown["at_target"][f"{t:g}"]) for t in SLO_TARGETS)
            out.append(f"| {rate:g} | {name} | {cells} | {pc(shown['answered'])} | "
                       f"{shown['cold_starts_per_min']:.2f} |")  # fmt: skip
    return out


def groups_note(rows: Sequence[dict[str, Any]]) -> list[str]:
    """The grouping swap-groups ran with (nothing when it did not run)."""
    out = []
    for r in rows:
        if r["policy"] == "swap-groups":
            group = ", ".join(r["resident"]) or "none"
            out += ["", f"swap-groups: resident together: {group}; the others swap by stop."]
    return out


def summary_table(rows: Sequence[dict[str, Any]]) -> list[str]:
    out = [
        "| policy | requests (served) | **SLO attainment** | warm / cold requests within it | "
        "TTFT p50 s | TTFT p99 s | swaps / min | cold starts / min | GPU-s starting / waking | "
        "late overtakes (all reorders) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        late = "-" if r["policy"] in SWAPPERS else (
            f"{r['late_overtakes']} ({r.get('reorders', 0)})")  # fmt: skip
        out.append(
            f"| {r['policy']} | {r['requests']} ({r['served_counted']}) | "
            f"**{pc(r['attainment'])}** | "
            f"{pc(r['attainment_warm'])} / {pc(r['attainment_cold'])} ({r['cold_requests']} cold)"
            f" | {f(r['ttft_p50'], 2)} | {f(r['ttft_p99'])} | {f(r['swaps_per_min'], 2)} | "
            f"{f(r['cold_starts_per_min'], 2)} | {f(r['start_gpu_s'], 0)} / "
            f"{f(r['wake_gpu_s'], 0)} | {late} |"
        )
    return out


def model_table(rows: Sequence[dict[str, Any]], shares: Sequence[float]) -> list[str]:
    pols = [r["policy"] for r in rows]
    out = [
        "| model | share | " + " | ".join(f"{p} met / p50 / p99 s" for p in pols) + " |",
        "|---|---:|" + "---:|" * len(pols),
    ]
    for i, pm in enumerate(rows[0]["per_model"]):
        cells = []
        for r in rows:
            x = r["per_model"][i]
            cells.append(f"{pc(x['attainment'])} / {f(x['ttft_p50'], 1)} / {f(x['ttft_p99'], 1)}")
        share = f"{100 * shares[i]:.1f} %" if i < len(shares) else "-"
        out.append(
            f"| {pm['model']} ({pm['requests']} req) | {share} | " + " | ".join(cells) + " |"
        )
    return out


def density(sweep: Sequence[dict[str, Any]], policy: str) -> int:
    """Models per GPU: the largest M whose attainment is at least 95 % (0: none)."""
    ok = [r["m"] for r in sweep if r["policy"] == policy and r["attainment"] >= TARGET]
    return max(ok) if ok else 0


def sweep_table(sweep: Sequence[dict[str, Any]], pols: Sequence[str]) -> list[str]:
    ms = sorted({r["m"] for r in sweep})
    at = {(r["policy"], r["m"]): r["attainment"] for r in sweep}
    out = ["| M | " + " | ".join(pols) + " |", "|---:|" + "---:|" * len(pols)]
    for m in ms:
        out.append(f"| {m} | " + " | ".join(pc(at.get((p, m), math.nan), 2) for p in pols) + " |")
    out.append("| **models per GPU at 95 %** | "
               + " | ".join(f"**{density(sweep, p)}**" for p in pols) + " |")  # fmt: skip
    return out


def goals(rows: Sequence[dict[str, Any]], sweep: Sequence[dict[str, Any]]) -> list[str]:
    """The issue's goals, met or missed, with the numbers."""
    at = {r["policy"]: r["attainment"] for r in rows}
    if not {"scheduler", "stop-on-swap", "sleep-on-swap"} <= at.keys():
        return []

    def ratio(a: float, b: float) -> str:
        return "inf" if b == 0 else f"{a / b:.2f}x"

    s, stop, snap = at["scheduler"], at["stop-on-swap"], at["sleep-on-swap"]
    zero = " (stop-on-swap meets the SLO for no request: any attainment meets this)"
    out = [
        f"* scheduler attainment >= 2x stop-on-swap: {pc(s)} vs {pc(stop)} ({ratio(s, stop)}): "
        f"**{'met' if s >= 2 * stop else 'missed'}**{zero if stop == 0 else ''}",
        f"* scheduler attainment >= 1.3x sleep-on-swap: {pc(s)} vs {pc(snap)} "
        f"({ratio(s, snap)}): **{'met' if s >= 1.3 * snap else 'missed'}**",
    ]
    if sweep:
        d, ds = density(sweep, "scheduler"), density(sweep, "stop-on-swap")
        top = max(r["m"] for r in sweep)
        note = f" (the sweep stops at {top})" if d == top else ""
        met = d >= 2 * ds and d > 0
        none = " (stop-on-swap reaches 95 % at no M)" if ds == 0 else ""
        out.append(f"* models per GPU at 95 % >= 2x stop-on-swap's: {d}{note} vs {ds}: "
                   f"**{'met' if met else 'missed'}**{none}")  # fmt: skip
    return out


# --------------------------------------------------------------------------- the plot

COLORS = {"stop-on-swap": "#d62728", "sleep-on-swap": "#ff7f0e", "swap-groups": "#9467bd",
          "planner": "#1f77b4", "scheduler": "#2ca02c"}  # fmt: skip
DASHED: set[str] = set()


def svg_plot(sweep: Sequence[dict[str, Any]], pols: Sequence[str], title: str) -> str:
    """Attainment against M, one line per policy, as a standalone SVG."""
    w, h, left, right, top, bottom = 760, 440, 64, 190, 48, 56
    pw, ph = w - left - right, h - top - bottom
    ms = sorted({r["m"] for r in sweep})
    lo, hi = ms[0], ms[-1]

    def x(m: float) -> float:
        return left + (pw * (m - lo) / (hi - lo) if hi > lo else pw / 2)

    def y(a: float) -> float:
        return top + ph * (1 - a)

    def esc(s: str) -> str:
        return s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")

    o = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" '
         f'viewBox="0 0 {w} {h}" font-family="sans-serif" font-size="12">',
         f'<rect width="{w}" height="{h}" fill="white"/>',
         f'<text x="{left}" y="24" font-size="14" font-weight="bold">'
         f"{esc(title)}</text>"]  # fmt: skip
    for k in range(0, 11, 2):
        a = k / 10
        o.append(f'<line x1="{left}" y1="{y(a):.1f}" x2="{left + pw}" y2="{y(a):.1f}" '
                 'stroke="#e5e5e5"/>')  # fmt: skip
        o.append(f'<text x="{left - 8}" y="{y(a) + 4:.1f}" text-anchor="end">{k * 10}%</text>')
    for m in ms:
        o.append(f'<line x1="{x(m):.1f}" y1="{top + ph}" x2="{x(m):.1f}" y2="{top + ph + 5}" '
                 'stroke="black"/>')  # fmt: skip
        o.append(f'<text x="{x(m):.1f}" y="{top + ph + 19}" text-anchor="middle">{m}</text>')
    o.append(f'<line x1="{left}" y1="{y(TARGET):.1f}" x2="{left + pw}" y2="{y(TARGET):.1f}" '
             'stroke="black" stroke-dasharray="6 4"/>')  # fmt: skip
    o.append(f'<text x="{left + pw + 6}" y="{y(TARGET) + 4:.1f}">95 %</text>')
    o.append(f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="none" stroke="black"/>')
    o.append(f'<text x="{left + pw / 2}" y="{h - 14}" text-anchor="middle">'
             'models on the GPU (M)</text>')  # fmt: skip
    o.append(f'<text transform="translate(18 {top + ph / 2}) rotate(-90)" '
             'text-anchor="middle">requests within the TTFT target</text>')  # fmt: skip
    for i, p in enumerate(pols):
        pts = sorted((r["m"], r["attainment"]) for r in sweep if r["policy"] == p)
        c = COLORS.get(p, "black")
        path = " ".join(f"{x(m):.1f},{y(a):.1f}" for m, a in pts)
        dash = ' stroke-dasharray="7 4"' if p in DASHED else ""
        o.append(f'<polyline points="{path}" fill="none" stroke="{c}" stroke-width="2.5"{dash}/>')
        o += [f'<circle cx="{x(m):.1f}" cy="{y(a):.1f}" r="3.5" fill="{c}"/>' for m, a in pts]
        ly = top + 16 + 22 * i
        o.append(f'<line x1="{left + pw + 44}" y1="{ly}" x2="{left + pw + 70}" y2="{ly}" '
                 f'stroke="{c}" stroke-width="2.5"{dash}/>')  # fmt: skip
        o.append(f'<text x="{left + pw + 76}" y="{ly + 4}">{esc(p)}</text>')
    o.append("</svg>")
    return "\n".join(o) + "\n"


# --------------------------------------------------------------------------- the command


def revision() -> str:
    """The git revision of the checkout, and whether vllm_proxy/ differs from it."""
    import subprocess

    def git(*a: str) -> str:
        run = subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True, check=False)
        return run.stdout.strip()

    head = git("rev-parse", "--short", "HEAD") or "unknown"
    return head + (
        " + uncommitted vllm_proxy/" if git("status", "--porcelain", "vllm_proxy") else ""
    )


def with_workload(
    prof: Profile, name: str | None, gpus: int | None = None
) -> tuple[Profile, dict[str, Any]]:
    """The profile with the named workload's sizes and GPUs (`gpus`, given, wins), and the
    workload (empty without a name)."""
    if name is None:
        return prof, {}
    preset = prof.workloads[name]
    mix = tuple(str(x) for x in preset.get("mix", prof.mix))
    count = gpus if gpus is not None else int(preset.get("gpus", prof.gpus))
    return replace(prof, mix=mix, gpus=count), preset


def host(prof: Profile) -> str:
    """The host in words: its GPUs and their memory."""
    gib = prof.total_mib / MIB_PER_GIB
    if prof.gpus == 1:
        return f"one {prof.gpu_name} ({gib:.1f} GiB)"
    return f"{prof.gpus} x {prof.gpu_name} ({gib:.1f} GiB each)"


def parse_range(text: str) -> list[int]:
    """``2-16``, ``2,4,8`` or ``none``."""
    if text in ("", "none", "0"):
        return []
    out: list[int] = []
    for part in text.split(","):
        a, _, b = part.partition("-")
        out += list(range(int(a), int(b) + 1)) if b else [int(a)]
    return out


def floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    g = p.add_argument_group("workload")
    g.add_argument(
        "--workload",
        default=None,
        help="a named workload of the profile ('workloads': unseen-20, two-gpu): its number "
        "of models, their sizes, the GPUs and the rate; options given here win",
    )
    g.add_argument("--models", type=int, default=None,
                   help="M for the main table (default 12, or the workload's)")  # fmt: skip
    g.add_argument("--sweep", default=None,
                   help="values of M for models-per-GPU ('none'; default 2-16, none with "
                   "--workload)")  # fmt: skip
    g.add_argument(
        "--rate",
        type=float,
        default=None,
        help=f"requests/s, all models (default {Traffic.rate:g}, or the workload's)",
    )
    g.add_argument("--zipf", type=float, default=Traffic.zipf, help="Zipf exponent")
    g.add_argument("--cv", type=float, default=Traffic.cv, help="inter-arrival CV (1 = Poisson)")
    g.add_argument("--seed", type=int, default=Traffic.seed)
    g.add_argument(
        "--seeds",
        type=int,
        default=Traffic.seeds,
        help="runs counted together (seeds --seed, --seed + 1, ...)",
    )
    g.add_argument("--duration-s", type=float, default=Traffic.duration_s, help="counted time")
    g.add_argument(
        "--warmup-s",
        type=float,
        default=None,
        help=f"simulated, not counted (default {Traffic.warmup_s:g}; 0 with --replay)",
    )
    g.add_argument("--prompt-median", type=float, default=Traffic.prompt_median)
    g.add_argument("--prompt-sigma", type=float, default=Traffic.prompt_sigma)
    g.add_argument("--output-median", type=float, default=Traffic.output_median)
    g.add_argument("--output-sigma", type=float, default=Traffic.output_sigma)
    g.add_argument("--replay", type=Path, help="CSV (time,model,...) or the proxy's access log")
    g = p.add_argument_group("GPU, engines and SLO")
    g.add_argument("--profile", type=Path, default=PROFILE, help="figures (YAML)")
    g.add_argument("--gpu-mib", type=int, default=None, help="GPU memory (default: profile's)")
    g.add_argument("--gpus", type=int, default=None,
                   help="GPUs of the host (default: the profile's, or the workload's)")  # fmt: skip
    g.add_argument("--sleep-level", type=int, choices=(1, 2), default=1)
    g.add_argument(
        "--slo-s",
        type=float,
        default=Settings.slo_s,
        help="the TTFT target of the headline column and models per GPU (every request)",
    )
    g.add_argument(
        "--give-up-s",
        type=float,
        default=None,
        help="clients hang up after waiting this long (every policy)",
    )
    g.add_argument(
        "--host-ram-gib",
        type=float,
        default=Settings.host_ram_gib,
        help="host RAM for level-1 sleeps (short: the proxy falls back to level 2)",
    )
    g.add_argument(
        "--no-idle-timers",
        action="store_true",
        help="without the shipped idle_timeout_s and sleep.after_idle_s",
    )
    g.add_argument(
        "--sleep-on-idle",
        choices=("needed", "always"),
        default=Settings.on_idle,
        help="sleep.on_idle: needed (the default) or always",
    )
    g.add_argument(
        "--idle-timeout-s",
        type=float,
        default=None,
        help="idle_timeout_s for every model (default: the shipped one; 0: engines are "
        "stopped only when their memory is needed)",
    )
    g.add_argument(
        "--also-idle-timeout-s",
        type=float,
        default=None,
        help="also the planner and the scheduler with this idle_timeout_s, at each rate",
    )
    g = p.add_argument_group("the scheduler's settings")
    g.add_argument(
        "--without",
        default="",
        help="scheduler rules to leave out, to measure each: " + ",".join(vproxy.ABLATIONS),
    )
    g.add_argument("--max-reorder-s", type=float, default=Settings.max_reorder_s)
    g.add_argument("--min-resident-s", type=float, default=Settings.min_resident_s)
    g.add_argument("--idle-grace-s", type=float, default=Settings.idle_grace_s)
    g.add_argument(
        "--queue-timeout-s",
        type=float,
        default=Settings.queue_timeout_s,
        help="a bring-up without memory this long fails (planner, scheduler)",
    )
    g.add_argument("--pair-s", type=float, default=None,
                   help="the two-client scenario's counted seconds (0: not run; default 1800, "
                   "0 with --workload)")  # fmt: skip
    g.add_argument("--tune", action="store_true", help="a grid of the three, several seeds")
    g.add_argument("--tune-seeds", type=int, default=5)
    g.add_argument("--tune-reorder", default="0,2,5,10,15")
    g.add_argument("--tune-resident", default="0,5,10,30,60")
    g.add_argument("--tune-grace", default="1,2,5")
    g.add_argument("--tune-policies", default="scheduler")
    g = p.add_argument_group("output")
    g.add_argument("--policies", default=",".join(POLICIES))
    g.add_argument("--per-model", action="store_true", help="also the per-model table")
    g.add_argument("--rates", default="", help="also the main table at these rates (a,b,...)")
    g.add_argument("--sweep-rates", default="", help="also the sweep over M at these rates")
    g.add_argument("--jobs", type=int, default=0, help="processes (default: one per CPU)")
    g.add_argument("--out", type=Path, default=RESULTS, help="raw numbers (JSON)")
    g.add_argument("--docs", action="store_true", help="write docs/benchmarks.md and the plot")
    args = p.parse_args(argv)

    workers = args.jobs or os.cpu_count() or 1
    prof = load_profile(args.profile, args.gpu_mib, args.gpus)
    if args.workload is not None:
        if args.workload not in prof.workloads:
            p.error(f"unknown workload {args.workload!r} (known: {', '.join(prof.workloads)})")
        if args.replay or args.docs:
            p.error("--workload goes with neither --replay nor --docs")
    prof, preset = with_workload(prof, args.workload, args.gpus)
    if args.models is None:
        args.models = int(preset.get("models", 12))
    if args.rate is None:
        args.rate = float(preset.get("rate", Traffic.rate))
    if args.sweep is None:
        args.sweep = "none" if args.workload else "2-16"
    if args.pair_s is None:
        args.pair_s = 0.0 if args.workload else 1800.0
    pols = [x for x in args.policies.split(",") if x]
    for x in pols:
        if x not in POLICIES:
            p.error(f"unknown policy {x!r} (known: {', '.join(POLICIES)})")
    st = Settings(args.slo_s, args.sleep_level, args.max_reorder_s,
                  args.min_resident_s, args.idle_grace_s, args.queue_timeout_s,
                  args.give_up_s, args.host_ram_gib, not args.no_idle_timers,
                  args.idle_timeout_s, tuple(x for x in args.without.split(",") if x),
                  args.sleep_on_idle)  # fmt: skip
    for x in st.without:
        if x not in vproxy.ABLATIONS:
            p.error(f"unknown rule {x!r} for --without (known: {', '.join(vproxy.ABLATIONS)})")
    warmup = args.warmup_s if args.warmup_s is not None else (0.0 if args.replay else 600.0)
    traffic = Traffic(args.rate, args.zipf, args.cv, args.seed, args.duration_s, warmup,
                      args.prompt_median, args.prompt_sigma, Traffic.prompt_max,
                      args.output_median, args.output_sigma, Traffic.output_max,
                      max(args.seeds, 1))  # fmt: skip
    began = time.monotonic()
    command = " ".join(["benchmarks/density.py", *(argv if argv is not None else sys.argv[1:])])
    on = host(prof)
    lines: list[str] = []
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    res: dict[str, Any] = {"command": command, "git": revision(), "when": when,
                           "profile": str(args.profile), "settings": asdict(st),
                           "traffic": asdict(traffic), "gpu": prof.gpu_name,
                           "gpu_mib": prof.total_mib, "gpus": prof.gpus,
                           "workload": args.workload, "mix": list(prof.mix)}  # fmt: skip

    if args.replay:
        records = read_replay(args.replay)
        arrivals, names, sizes = replay_workload(records, prof, traffic)
        span = arrivals[-1].time
        measured = max(span - warmup, 1.0)
        rows = []
        for x in pols:
            r = simulate(x, arrivals, names, sizes, prof, st, warmup, measured + 1e-9)
            rows.append({**r.summary(), "per_model": r.per_model()})
        counts = [sum(1 for a in arrivals if a.model == i) for i in range(len(names))]
        shares = [c / len(arrivals) for c in counts]
        lines += [f"Replay of {args.replay} ({len(arrivals)} requests over {span:,.0f} s, "
                  f"{len(names)} models) on {on}.", ""]  # fmt: skip
        lines += [*summary_table(rows), "", *targets_table(rows), *groups_note(rows), "",
                  *model_table(rows, shares)]  # fmt: skip
        res.update(replay=str(args.replay), main=rows)
        _print(lines, command)
        _save(args.out, res)
        return _status(rows)

    m = args.models
    jobs = [(x, m, prof, traffic, st) for x in pols]
    ms = parse_range(args.sweep)
    jobs += [(x, k, prof, traffic, st) for k in ms if k != m for x in pols]
    rates = floats(args.rates)
    jobs += [(x, m, prof, replace(traffic, rate=q), st) for q in rates if q != traffic.rate
             for x in pols]  # fmt: skip
    extra = [q for q in floats(args.sweep_rates) if q != traffic.rate]
    jobs += [(x, k, prof, replace(traffic, rate=q), st) for q in extra for k in ms for x in pols]
    proxies = [x for x in pols if x not in SWAPPERS]
    alt = None if args.also_idle_timeout_s is None else replace(
        st, idle_timeout_s=args.also_idle_timeout_s)  # fmt: skip
    alt_jobs = [] if alt is None else [
        (x, m, prof, replace(traffic, rate=q), alt)
        for q in [traffic.rate, *[q for q in rates if q != traffic.rate]] for x in proxies
    ]  # fmt: skip
    done_all = run_jobs(jobs + alt_jobs, workers)
    done, alt_done = done_all[: len(jobs)], done_all[len(jobs) :]
    main_rows = done[: len(pols)]
    sweep = [r for r, j in zip(done, jobs, strict=True) if j[1] in ms and j[3] == traffic]
    by_rate = {q: [r for r, j in zip(done, jobs, strict=True) if j[1] == m and j[3].rate == q]
               for q in [traffic.rate, *rates]}  # fmt: skip
    shares = zipf_shares(m, traffic.zipf)
    awake = sum(prof.sizes[prof.mix[i % len(prof.mix)]].awake_mib for i in range(m))
    named = f"Workload {args.workload}: " if args.workload else ""
    head = (f"{named}{m} models ({awake / MIB_PER_GIB:,.0f} GiB awake) on {on}, "
            f"{traffic.rate:g} requests/s, "
            f"Zipf {traffic.zipf:g}, inter-arrival CV {traffic.cv:g}, "
            f"{_seeds(traffic)}, "
            f"{traffic.duration_s:,.0f} s counted after {warmup:,.0f} s; SLO: TTFT <= "
            f"{st.slo_s:g} s for every request; "
            f"scheduler: max_reorder_s {st.max_reorder_s:g}, min_resident_s "
            f"{st.min_resident_s:g}, idle_grace_s {st.idle_grace_s:g}"
            + (f", without {', '.join(st.without)}" if st.without else "")
            + f"; queue_timeout_s {st.queue_timeout_s:g}.")  # fmt: skip
    lines += [head, "", *summary_table(main_rows), "", *targets_table(main_rows),
              *groups_note(main_rows)]  # fmt: skip
    if args.per_model or args.docs or args.workload:
        lines += ["", "Per model (share of requests; met = within the SLO; TTFT p50 / p99 s):", ""]
        lines += model_table(main_rows, shares)
    if rates:
        lines += ["", "SLO attainment by request rate (M = " + str(m) + "):", ""]
        lines += ["| requests/s | " + " | ".join(pols) + " |", "|---:|" + "---:|" * len(pols)]
        for q, rs in sorted(by_rate.items()):
            at = {r["policy"]: r["attainment"] for r in rs}
            lines.append(f"| {q:g} | " + " | ".join(pc(at[x]) for x in pols) + " |")
    if sweep:
        lines += ["", f"SLO attainment by number of models ({traffic.rate:g} requests/s in all, "
                  "Zipf over the M models):", ""]  # fmt: skip
        lines += sweep_table(sweep, pols)
    sweeps = {traffic.rate: sweep}
    for q in extra:
        other = [r for r, j in zip(done, jobs, strict=True) if j[1] in ms and j[3].rate == q
                 and j[3] == replace(traffic, rate=q)]  # fmt: skip
        sweeps[q] = other
        lines += ["", f"The same at {q:g} requests/s:", "", *sweep_table(other, pols)]
    if alt is not None:
        lines += [
            "",
            f"The planner and the scheduler with `idle_timeout_s: {alt.idle_timeout_s:g}`"
            " (an idle engine, awake or asleep, is stopped only when its memory is "
            f"needed), M = {m}:",
            "",
            *alt_table(alt_jobs, alt_done, main_rows, by_rate),
        ]
        res["also_idle_timeout"] = {"idle_timeout_s": alt.idle_timeout_s, "rows": [
            {**{k: v for k, v in r.items() if k != "per_model"}, "rate": j[3].rate}
            for r, j in zip(alt_done, alt_jobs, strict=True)]}  # fmt: skip
    lines += ["", *goals(main_rows, sweep)]
    by_policy = {r["policy"]: r for r in main_rows}
    if "scheduler" in by_policy and len(by_policy) > 1:
        lines.append(standing(by_policy, {str(q): rs for q, rs in sweeps.items()},
                              {str(q): rs for q, rs in by_rate.items()}))  # fmt: skip
    if args.pair_s > 0:
        pair_lines, res["pair"] = pair(args, st, pols, args.pair_s)
        lines += ["", *pair_lines]
    res["main"] = main_rows
    res["sweep"] = {str(q): [{k: v for k, v in r.items() if k != "per_model"} for r in rs]
                    for q, rs in sweeps.items()}  # fmt: skip
    res["rates"] = {str(q): [{k: v for k, v in r.items() if k != "per_model"} for r in rs]
                    for q, rs in by_rate.items()}  # fmt: skip
    tune_lines: list[str] = []
    if args.tune:
        tune_lines, res["tune"] = tune(args, prof, traffic, st, m, workers)
        lines += ["", *tune_lines]
    res["wall_s"] = time.monotonic() - began
    _print(lines, command)
    _save(args.out, res)
    if args.docs:
        title = (f"SLO attainment vs models on one {prof.gpu_name}, {traffic.rate:g} req/s, "
                 f"Zipf {traffic.zipf:g}, CV {traffic.cv:g}")  # fmt: skip
        if sweep:
            PLOT.parent.mkdir(parents=True, exist_ok=True)
            PLOT.write_text(svg_plot(sweep, pols, title))
        section = docs_section(lines, command, prof, traffic, m, res)
        docs_writer.put_sections(DOCS, SECTION + "\n\n" + "\n".join(section))
    checked = [*main_rows, *(r for rs in sweeps.values() for r in rs)]
    checked += [r for rs in by_rate.values() for r in rs]
    checked += [{"policy": x, "over_commits": 1, "busy_evictions": 0, "unserved": 0}
                for x in res.get("tune", {}).get("broken", [])]  # fmt: skip
    return _status(checked)


#: The two-client scenario: two 8B models on a GPU that holds one awake and the other asleep.
PAIR_SIZE = "8b"
PAIR_GPU_MIB = 40 * MIB_PER_GIB


def pair(
    args: argparse.Namespace, st: Settings, pols: Sequence[str], duration_s: float
) -> tuple[list[str], list[dict[str, Any]]]:
    """Two clients, one model each, each sending its next request as soon as the last is
    answered, on a GPU that holds one of the two awake: what makes a naive proxy swap after
    every answer. The scheduler runs as set, and with no minimum residency beside it."""
    prof = load_profile(args.profile, PAIR_GPU_MIB)
    size = prof.sizes[PAIR_SIZE]
    names, sizes = [f"a-{size.name}", f"b-{size.name}"], [size, size]
    prompt, output = int(args.prompt_median), int(args.output_median)
    clients = [Client(0, 0.0, prompt, output), Client(1, 0.0, prompt, output, first_s=0.5)]
    runs = [(x, st) for x in pols]
    if "scheduler" in pols and st.min_resident_s > 0:
        runs.append(("scheduler", replace(st, min_resident_s=0.0)))
    rows = []
    for x, s_ in runs:
        r = simulate(x, [], names, sizes, prof, s_, 60.0, duration_s, clients).summary()
        r["settings"] = (
            f"{s_.max_reorder_s:g} / {s_.min_resident_s:g} / {s_.idle_grace_s:g}"
            if x == "scheduler" else ""
        )  # fmt: skip
        r["answers_per_min"] = r["served_counted"] / (duration_s / 60)
        rows.append(r)
    out = [f"Two clients, one {size.name} model each, back to back (the next request as soon as "
           f"the last is answered; {prompt} prompt and {output} output tokens), on "
           f"{PAIR_GPU_MIB // MIB_PER_GIB} GiB: one model awake and the other asleep fit, two "
           f"awake do not. {duration_s:,.0f} s counted.", "",
           "| policy | max_reorder_s / min_resident_s / idle_grace_s | answers/min | swaps/min "
           "| TTFT p50 / p99 s | SLO attainment |",
           "|---|---|---:|---:|---:|---:|"]  # fmt: skip
    for r in rows:
        out.append(f"| {r['policy']} | {r['settings']} | {r['answers_per_min']:.1f} | "
                   f"{r['swaps_per_min']:.2f} | {f(r['ttft_p50'], 2)} / {f(r['ttft_p99'], 1)} | "
                   f"{pc(r['attainment'])} |")  # fmt: skip
    return out, rows


def tune(
    args: argparse.Namespace, prof: Profile, traffic: Traffic, st: Settings, m: int, workers: int
) -> tuple[list[str], dict[str, Any]]:
    """The scheduler over a grid of its three settings, each on
    several seeds, beside the planner on the same seeds."""
    keys = ("max_reorder_s", "min_resident_s", "idle_grace_s")
    grid = [(a, b, c) for a in floats(args.tune_reorder) for b in floats(args.tune_resident)
            for c in floats(args.tune_grace)]  # fmt: skip
    seeds = [traffic.seed + k for k in range(args.tune_seeds)]
    pols = [x for x in args.tune_policies.split(",") if x]
    jobs = [("planner", m, prof, replace(traffic, seed=s), st) for s in seeds]
    jobs += [(x, m, prof, replace(traffic, seed=s),
              replace(st, max_reorder_s=a, min_resident_s=b, idle_grace_s=c))
             for x in pols for a, b, c in grid for s in seeds]  # fmt: skip
    done = run_jobs(jobs, workers)
    broken = [
        r["policy"] for r in done if r["over_commits"] or r["busy_evictions"] or r["unserved"]
    ]
    base = done[: len(seeds)]
    planner = sum(r["attainment"] for r in base) / len(base)
    rows = []
    k = len(seeds)
    for x in pols:
        for a, b, c in grid:
            rs = done[k : k + len(seeds)]
            k += len(seeds)
            rows.append({"policy": x, "max_reorder_s": a, "min_resident_s": b, "idle_grace_s": c,
                         "attainment": sum(r["attainment"] for r in rs) / len(rs),
                         "worst_seed": min(r["attainment"] for r in rs),
                         "vs_planner": sum(r["attainment"] - q["attainment"]
                                           for r, q in zip(rs, base, strict=True)) / len(rs),
                         "timed_out": sum(r["timed_out"] for r in rs) / len(rs),
                         "late_overtakes": sum(r["late_overtakes"] for r in rs),
                         "reorders": sum(r.get("reorders", 0) for r in rs)})  # fmt: skip
    rows.sort(key=lambda r: (-r["attainment"], r["timed_out"]))
    out = [f"Scheduler settings: {len(grid)} combinations x {len(seeds)} seeds "
           f"({seeds[0]}-{seeds[-1]}), M = {m}, the workload above; the planner on the same "
           f"seeds: {pc(planner)}. The best ten:", "",
           "| policy | max_reorder_s | min_resident_s | idle_grace_s | attainment (mean) | "
           "worst seed | vs planner (points) | timed out per run | late overtakes (all "
           "seeds; all reorders) |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in rows[:10]:
        out.append(f"| {r['policy']} | {r['max_reorder_s']:g} | {r['min_resident_s']:g} | "
                   f"{r['idle_grace_s']:g} | {pc(r['attainment'])} | {pc(r['worst_seed'])} | "
                   f"{100 * r['vs_planner']:+.2f} | {r['timed_out']:.0f} | "
                   f"{r['late_overtakes']} ({r['reorders']}) |")  # fmt: skip
    out.append("")
    for x in pols:
        best = next(r for r in rows if r["policy"] == x)
        for key in keys:
            others = [o for o in keys if o != key]
            line = [r for r in rows
                    if r["policy"] == x and all(r[o] == best[o] for o in others)]  # fmt: skip
            line.sort(key=lambda r: r[key])
            cells = ", ".join(f"{r[key]:g}: {pc(r['attainment'])}" for r in line)
            out.append(f"* {x}, {key} alone (the others as in its best row): {cells}")
    return out, {"planner": planner, "rows": rows, "broken": broken}


def docs_section(
    lines: list[str], command: str, prof: Profile, traffic: Traffic, m: int, res: dict[str, Any]
) -> list[str]:
    """The section of docs/benchmarks.md: method, figures, the tables, a reading, the limits."""
    t = prof.timing
    fig = ["| size | weights GiB | awake GiB | asleep GiB | cold start s | wake L1 / L2 s | "
           "first / later L1 sleep s | prefill tok/s | decode tok/s |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for s in prof.sizes.values():
        fig.append(f"| {s.name} | {s.weights_gib:g} | {s.footprint_gib:g} | {s.residue_gib:g} | "
                   f"{prof.start_s(s):.0f} | {prof.wake_s(s, 1):.1f} / {prof.wake_s(s, 2):.1f} | "
                   f"{prof.sleep_s(s, 1, True):.1f} / {prof.sleep_s(s, 1, False):.1f} | "
                   f"{s.prefill_tok_s:,.0f} | {s.decode_tok_s:,.0f} |")  # fmt: skip
    mix = [prof.sizes[prof.mix[i % len(prof.mix)]] for i in range(m)]
    pinned = sum(s.weights_gib for s in mix)
    awake = sum(s.footprint_gib for s in mix)
    return [
        "`benchmarks/density.py` answers *how many models one GPU serves within a latency "
        "target*. It runs in virtual time (no GPU, no engine): M models share one GPU and the "
        "policies serve the same requests. The planner and the scheduler are the proxy's own "
        "code: its `Manager`, `Instance`s, `Admission`, memory accounting on a static budget, "
        "admission queue and host-RAM check, built from a parsed config with the shipped "
        "defaults; only the engine process is virtual (the profile's start, sleep, wake and "
        "stop times) and the clock jumps to the next timer (`benchmarks/vproxy.py`). "
        "`tests/bench/test_density_differential.py` runs one small trace through this engine model "
        "and through the proxy on fake engines, both with the shipped defaults, and checks that "
        "both take the same starts, sleeps, wakes and stops and answer alike, and that each "
        "request's time to first token in the model lies between what the proxy showed it must "
        "wait for (a start, a wake) and what it took there. The one-model policies and "
        "llama-swap's groups are a discrete-event simulation of those tools. The method is in "
        "the script's docstring. Every run checks that GPU memory is never over-committed and "
        "that no engine with a request in flight is put to sleep or stopped (every run below: "
        "none), and the test suite runs it at a small size (`tests/bench/test_density.py`).",
        "",
        f"Figures (`benchmarks/density_profile.yaml`, the one file to change them, each figure "
        f"with its source there; {prof.gpu_name}, {prof.total_mib} MiB, {prof.reserve_mib} MiB "
        f"kept free; stop {t['stop_s']:g} s, level-2 sleep {t['sleep_l2_s']:g} s):",
        "",
        *fig,
        "",
        "Sources: the vLLM blog on sleep mode (https://blog.vllm.ai/2025/10/26/sleep-mode.html:"
        " switches without sleep mode 37.6-58.1 s, level-1 wakes 0.26-0.82 s, level-2 wakes "
        "0.85-2.58 s on an A100), vllm-project/vllm#48337 (8B: level-1 sleep 10.6 s, wake 2.2 s;"
        " level-2 sleep 0.3 s, wake 6.5 s), a vLLM log of a first level-1 sleep (42 s for 75 "
        "GiB, 5.8 GiB left on the GPU), and NVIDIA's H100 figures (3.35 TB/s, 989 TFLOPS BF16). "
        "The decode rates read the weights at 27 % of the H100's bandwidth, what a measurement "
        "of one decode stream on an H100 found; the prefill rates assume 40 % of its BF16 "
        "compute (an estimate). Later level-1 sleeps copy at a wake's speed (an estimate; a "
        "sleep-and-wake swap in 3 s that is of the same order is a 4-GPU mixture-of-experts "
        "case, ~17 GiB per GPU, not a one-GPU figure). The footprints (awake) and residues "
        "(asleep) are estimates, not measurements: the weights plus a KV-cache budget that "
        "grows with the model plus ~1 GiB, and the proxy's 768 MiB context guess plus a share "
        "growing with the model. A cold start is the engine's fixed set-up, the weights read at "
        "the level-2 reload rate, the compile from the cache the proxy keeps per model and the "
        "CUDA-graph capture; only its total for a 0.6B model is sourced (the blog's 37.6 s; "
        "Baseten's torch-compile-cache doc gives 5-20 s for a cached compile), the split is an "
        "estimate. The stop time is an estimate (no published figure).",
        "",
        f"Workload: the models take the sizes 7B, 3B, 14B, 1.5B, 8B, 0.5B in turn, the most "
        f"popular first ({m} models hold {awake:g} GiB awake, against {prof.total_mib / 1024:.1f}"
        f" GiB). {traffic.rate:g} requests/s in all ({traffic.rate * 3600:,.0f} an hour) is a "
        "team sharing one GPU across a dozen models, most of them idle most of the time; the "
        "rate table shows 0.05 to 1. Each model's requests are bursty on their own (gamma "
        f"gaps, CV {traffic.cv:g}), prompts lognormal around {traffic.prompt_median:g} tokens, "
        f"answers around {traffic.output_median:g}.",
        "",
        *lines,
        "",
        "![SLO attainment against the number of models](benchmarks/density.svg)",
        "",
        "What the numbers say:",
        "",
        *reading(res),
        "",
        "What runs as in the proxy (planner and scheduler): admission, the queue and its "
        "rules, holds, turns, minimum residency, `queue_timeout_s` (503s), the idle timers as "
        "shipped (`idle_timeout_s`, `sleep.after_idle_s`), the device locks (starts and "
        "sleeps alone, wakes and stops beside each other), and the host-RAM check with its "
        "level-2 fallback (host RAM "
        f"{res['settings']['host_ram_gib']:g} GiB; {m} models would pin {pinned:.0f} GiB at "
        "level 1). What is not simulated: vLLM itself (the engine times are the profile's, "
        "fixed per size, with no noise), KV-cache pressure and preemption inside one engine "
        "(each stream decodes at its own rate, however many there are), engines slowing each "
        "other down on the same GPU, start and wake failures, memory that grows during a start "
        "(the footprint is taken at once), a first start with an empty compile cache, several "
        "GPUs and tensor parallelism, request priorities (every rank is equal). Clients give up "
        "only with `--give-up-s`.",
        "",
        f"`.venv/bin/python {command}` ({res['when']}, git {res['git']}; "
        f"{res.get('wall_s', 0) / 60:.0f} minutes on {os.cpu_count()} cores)",
    ]


def reading(res: dict[str, Any]) -> list[str]:
    """What the tables say, with their numbers."""
    rows = {r["policy"]: r for r in res.get("main", [])}
    sweeps = res.get("sweep", {})
    out = []
    stop, snap = rows.get("stop-on-swap"), rows.get("sleep-on-swap")
    plan_, sched = rows.get("planner"), rows.get("scheduler")
    if stop is not None:
        best = max((density(rs, "stop-on-swap") for rs in sweeps.values()), default=0)
        reach = "no M reaches 95 % at any rate swept" if best == 0 else f"{best} models at most"
        out.append(
            "* One model at a time with stops (llama-swap) cannot keep up: every swap is a stop "
            f"and a cold start, {stop['swaps_per_min']:.2f} a minute is all the GPU manages; "
            f"{pc(stop['at_target']['60'])} of requests get a first token within 60 s, "
            f"{pc(stop['answered'])} are answered at all, and {reach}."
        )
    if snap is not None:
        out.append(
            "* With sleeps instead (llmsnap) a swap takes seconds, but every model still waits "
            f"for the one before it: {snap['swaps_per_min']:.1f} swaps a minute, "
            f"{pc(snap['attainment'])} within the SLO."
        )
    if plan_ is not None and sched is not None:
        diff = 100 * (sched["attainment"] - plan_["attainment"])
        by_rate = []
        for q, rs in sorted(res.get("rates", {}).items(), key=lambda kv: float(kv[0])):
            at = {r["policy"]: r["attainment"] for r in rs}
            if "planner" in at and "scheduler" in at:
                by_rate.append(f"{float(q):g}: {100 * (at['scheduler'] - at['planner']):+.1f}")
        out.append(
            f"* The scheduler against the planner: {pc(sched['attainment'])} and "
            f"{pc(plan_['attainment'])} in the headline column ({diff:+.1f} points)"
            + (f"; by request rate, in points: {', '.join(by_rate)}" if by_rate else "")
            + "."
        )
        if snap is not None:
            ahead = [t for t in sched["at_target"]
                     if snap["at_target"][t] > max(sched["at_target"][t],
                                                   plan_["at_target"][t])]  # fmt: skip
            text = (
                f"* The proxy against one model at a time with sleeps (llmsnap), within 10 s: "
                f"scheduler {pc(sched['at_target']['10'])}, planner "
                f"{pc(plan_['at_target']['10'])}, sleep-on-swap {pc(snap['at_target']['10'])};"
                f" answered at all: {pc(sched['answered'])}, {pc(plan_['answered'])} and "
                f"{pc(snap['answered'])}; cold starts a minute: "
                f"{sched['cold_starts_per_min']:.2f}, {plan_['cold_starts_per_min']:.2f} and "
                f"{snap['cold_starts_per_min']:.2f}."
            )
            if ahead:
                text += (
                    f" At this load sleep-on-swap is ahead of both at {', '.join(ahead)} s: the "
                    "proxy keeps several models awake, so a wake can find the GPU held by busy "
                    "engines; it waits for them until queue_timeout_s less one reorder window, "
                    "then stops asleep engines (each later costs a cold start, with the device "
                    "locked meanwhile) or answers 503 at queue_timeout_s, and the idle timer "
                    "stops engines asleep for idle_timeout_s (600 s as shipped). Sleep-on-swap "
                    "serves one model at a time from one FIFO without a time-out and keeps "
                    "every model asleep on the GPU (within the same host RAM: level 2 where "
                    "the weights do not fit)."
                )
            out.append(text)
        out.append(
            f"* Bounded reordering: {sched['late_overtakes']} late overtakes for the scheduler "
            "(a model that began waiting more than the reorder window after another took "
            "memory that the other's plan needed), against "
            f"{plan_['late_overtakes']} for the planner; all reorders, needed memory or not: "
            f"{sched.get('reorders', 0)} and {plan_.get('reorders', 0)}."
        )
    groups = rows.get("swap-groups")
    if groups is not None:
        at = groups["at_target"]
        out.append(
            f"* llama-swap with groups keeps {', '.join(groups['resident']) or 'no model'} "
            f"resident together and swaps the others by stop: {pc(at['10'])} within 10 s, "
            f"{pc(at['60'])} within 60 s, {pc(groups['answered'])} answered at all. Its resident "
            "group is fast; the swap group is one FIFO of cold starts, as stop-on-swap."
        )
    alt = res.get("also_idle_timeout")
    if alt:
        rows_ = {(r["policy"], r["rate"]): r for r in alt["rows"]}
        main_rate = res["traffic"]["rate"]
        x = rows_.get(("scheduler", main_rate))
        snap = rows.get("sleep-on-swap")
        if x is not None:
            text = (
                f"* With `idle_timeout_s: {alt['idle_timeout_s']:g}` (an idle engine, awake or "
                f"asleep, is stopped only when its memory is needed) the scheduler answers "
                f"{pc(x['at_target']['10'])} within 10 s and {pc(x['answered'])} at all at "
                f"{main_rate:g} requests/s, with {x['cold_starts_per_min']:.2f} cold starts a "
                "minute"
            )
            if snap is not None:
                text += (f" (sleep-on-swap {pc(snap['at_target']['10'])} and "
                         f"{pc(snap['answered'])})")  # fmt: skip
            out.append(text + "; the table above gives every target and rate. Asleep engines "
                       "then hold their host RAM (level 1) until memory is needed; the proxy "
                       "falls back to level 2 where host RAM is short.")  # fmt: skip
    pair_rows = res.get("pair") or []
    plan_pair = next((r for r in pair_rows if r["policy"] == "planner"), None)
    sched_pair = [r for r in pair_rows if r["policy"] == "scheduler"]
    if plan_pair is not None and sched_pair:
        on, *off = sched_pair
        text = (
            f"* Two back-to-back clients of two models that do not fit awake together: the "
            f"planner {plan_pair['swaps_per_min']:.1f} swaps a minute, "
            f"{plan_pair['answers_per_min']:.1f} answers a minute, {pc(plan_pair['attainment'])}"
            f" within the SLO; the scheduler ({on['settings']}) {on['swaps_per_min']:.1f} swaps, "
            f"{on['answers_per_min']:.1f} answers a minute, {pc(on['attainment'])}."
        )
        if off:
            text += (
                f" Without a minimum residency ({off[0]['settings']}): "
                f"{off[0]['swaps_per_min']:.1f} swaps, {off[0]['answers_per_min']:.1f} answers a "
                f"minute, {pc(off[0]['attainment'])}. The planner's answers go to whichever "
                "client holds the GPU (tests/bench/test_density.py: the other one is starved); the "
                "scheduler serves both in turns, at the price of the swaps."
            )
        out.append(text)
    tune_ = res.get("tune")
    if tune_:
        best_row: dict[str, dict[str, Any]] = {}
        for r in tune_["rows"]:
            best_row.setdefault(r["policy"], r)
        for x, r in best_row.items():
            out.append(
                f"* Best settings for {x} (grid above): max_reorder_s {r['max_reorder_s']:g}, "
                f"min_resident_s {r['min_resident_s']:g}, idle_grace_s {r['idle_grace_s']:g}: "
                f"{pc(r['attainment'])}, {100 * r['vs_planner']:+.2f} points against the "
                f"planner on the same seeds, {r['late_overtakes']} late overtakes."
            )
        out.append(
            "* A minimum residency makes a waiter sit out its whole window when the engine it "
            "needs is protected, and the window is max_reorder_s long; idle_grace_s "
            "matters only while it is on. The window is capped at half of queue_timeout_s "
            "(15 s with the default 30 s)."
        )
    return out


#: Student's t, one-sided 95 %, by degrees of freedom (seeds - 1).
T95 = {1: 6.314, 2: 2.920, 3: 2.353, 4: 2.132, 5: 2.015, 6: 1.943, 7: 1.895, 8: 1.860,
       9: 1.833, 10: 1.812}  # fmt: skip


def paired_gap(p: dict[str, Any], x: dict[str, Any], t: str) -> tuple[float, float | None]:
    """The proxy (`x`) less another policy (`p`) at target `t` in points, over every request
    of every seed; and the upper one-sided 95 % bound of the mean of the per-seed gaps (each
    seed's two runs saw the same requests): below zero, the proxy is behind by more than
    the seeds' spread (None: fewer than two seeds)."""
    gap = 100 * (x["at_target"][t] - p["at_target"][t])
    ps, xs = p.get("by_seed") or [], x.get("by_seed") or []
    if len(ps) < 2 or len(ps) != len(xs):
        return gap, None
    diffs = [
        100 * (b["hits"][t] - a["hits"][t]) / a["requests"] for a, b in zip(ps, xs, strict=True)
    ]
    n = len(diffs)
    mean = sum(diffs) / n
    sd = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (n - 1))
    return gap, mean + T95.get(n - 1, 1.645) * sd / math.sqrt(n)


def behind(p: dict[str, Any], x: dict[str, Any]) -> tuple[list[str], list[str]]:
    """The targets where the proxy (`x`) has fewer requests within it than another policy
    (`p`): those below by more than the seeds' spread, and those below within it (a few
    requests that one seed gives one way and the next the other)."""
    beyond: list[str] = []
    within: list[str] = []
    for t in p["at_target"]:
        gap, bound = paired_gap(p, x, t)
        if gap >= -0.05:
            continue
        lost = round((p["at_target"][t] - x["at_target"][t]) * p["requests"])
        cell = f"{t} s {gap:+.1f} ({lost} of {p['requests']} requests)"
        (within if bound is not None and bound >= 0 else beyond).append(cell)
    return beyond, within


def standing(main: dict[str, dict[str, Any]], sweeps: dict[str, list[dict[str, Any]]],
             rates: dict[str, list[dict[str, Any]]] | None = None,
             proxy: str = "scheduler") -> str:  # fmt: skip
    """The proxy with its shipped defaults (`proxy`) against the issue's goal: at or above every
    other policy at every target on every workload (the main one, each rate, each M of each
    sweep), each pair of runs compared seed by seed (`behind`), with no late overtake."""
    x = main[proxy]
    others = [p for p in main if p != proxy]
    workloads: dict[str, dict[str, dict[str, Any]]] = {}
    if not rates:
        workloads["the main workload"] = main
    for q, rs in sorted((rates or {}).items(), key=lambda kv: float(kv[0])):
        for r in rs:
            workloads.setdefault(f"M = {r['m']} at {float(q):g} req/s", {})[r["policy"]] = r
    for q, rs in sorted(sweeps.items(), key=lambda kv: float(kv[0])):
        for m in sorted({r["m"] for r in rs}):
            where = f"M = {m} at {float(q):g} req/s"
            if where in workloads:
                continue
            workloads[where] = {r["policy"]: r for r in rs if r["m"] == m}
    late = max([x.get("late_overtakes", 0),
                *(by[proxy].get("late_overtakes", 0) for by in workloads.values()
                  if proxy in by)])  # fmt: skip
    beyond, within = [], []
    for where, by in workloads.items():
        if proxy not in by:
            continue
        for p in others:
            if p not in by:
                continue
            far, near = behind(by[p], by[proxy])
            if far:
                beyond.append(f"{p} at {where} ({', '.join(far)})")
            if near:
                within.append(f"{p} at {where} ({', '.join(near)})")
    ten = ", ".join(
        f"{p} {100 * (x['at_target']['10'] - main[p]['at_target']['10']):+.1f}" for p in others
    )
    met = not beyond and late == 0
    text = (
        f"* Against the goal (the {proxy} with the shipped defaults at or above every other "
        "policy at every target on every workload, each pair compared seed by seed, and no "
        f"late overtake): within 10 s on the main workload it is, in points, {ten}; the most "
        f"late overtakes in one run: {late}; "
    )
    if beyond:
        text += (
            "it is behind, by more than the seeds' spread, "
            + "; ".join(beyond)
            + " (points, with the requests it has fewer within the target)."
        )
    else:
        text += "it is nowhere behind any other policy by more than the seeds' spread."
    if within:
        text += (
            " It has fewer requests within a target, by less than the seeds' spread (the two "
            "policies on the same seed's requests, the per-seed gaps' mean not below zero at "
            "one-sided 95 %: a few requests that one seed tips one way and another the "
            "other), than " + "; ".join(within) + "."
        )
    return text + f" The goal is **{'met' if met else 'not met'}**."


def _print(lines: list[str], command: str) -> None:
    print("\n".join(lines))
    print(f"\n.venv/bin/python {command}")


def _save(path: Path, res: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(res, indent=1, default=str) + "\n")


def _status(rows: Sequence[dict[str, Any]]) -> int:
    """Non-zero when a run broke an invariant (memory over-committed, a busy engine evicted,
    a request never served)."""
    bad = [r["policy"] for r in rows
           if r["over_commits"] or r["busy_evictions"] or r["unserved"]]  # fmt: skip
    if bad:
        print(f"invariant broken in: {', '.join(sorted(set(bad)))}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
