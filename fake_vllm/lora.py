"""LoRA adapters in the fake engine, as vLLM 0.33 serves them at run time.

With ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`` (or ``1``) the server has
``POST /v1/load_lora_adapter {"lora_name", "lora_path", "load_inplace"?}`` and
``POST /v1/unload_lora_adapter {"lora_name"}``; without it they answer 404
``{"detail":"Not Found"}`` (vLLM does not register them). Their answers follow vLLM's
``OpenAIServingModels``: 200 with the text ``Success: LoRA adapter 'NAME' added
successfully.`` (``removed`` for an unload); 400 for a missing name or path, a name that is a
served model, or an adapter already loaded (unless ``load_inplace``); 404
``Loading lora NAME failed: No adapter found for PATH`` when the path holds no
``adapter_config.json``; 500 when ``--enable-lora`` is missing, when the adapter's rank
(``r`` and ``rank_pattern``) is above ``--max-lora-rank`` (default 16), or for an adapter named
in ``FAKE_ENGINE_LORA_FAIL``; 404 ``The lora adapter 'NAME' cannot be found.`` for an unload
of one not loaded. Loads of one name run one at a time (vLLM's per-name lock) and take
``FAKE_ENGINE_LORA_LOAD_DELAY`` seconds. As in vLLM, the number registered is not bounded
(``--max-loras`` bounds a batch in vLLM; the fake accepts it and ``--max-cpu-loras``).

A loaded adapter is listed by ``/v1/models`` (``parent`` = the first served name, ``root`` =
its path, ``max_model_len`` null); a request naming it is answered with ``model`` = the
adapter and the tokens ``<name>:tok0 <name>:tok1 ...``, so output differs per adapter; a
request naming one that is not loaded gets vLLM's 404 for an unknown model. Sleeps of any level
keep the adapters registered: vLLM's API registry is untouched by them
(``entrypoints/openai/models/serving.py:167-230``) and its worker reloads an adapter lazily after
``reload_weights`` reset them (``v1/worker/lora_model_runner_mixin.py:31-41``), while the LoRA
slots live in the ``runtime`` pool that both levels keep (``:57-63``).

Fake-only series on ``/metrics``: ``fake_engine:lora_loads_total{lora_name}`` (loads that
succeeded), ``fake_engine:lora_unloads_total{lora_name}``,
``fake_engine:lora_requests_total{lora_name}`` and ``fake_engine:lora_loaded{lora_name}``
(1 while loaded).
"""

import asyncio
import json
import os
from collections import Counter, defaultdict
from collections.abc import Callable
from typing import Any

from aiohttp import web

from .protocol import dumps, error, read_json, validation
from .settings import Settings

#: What vLLM answers when an adapter's load fails for a reason of its own.
FAIL_MESSAGE = "Loading lora {name} failed: fake failure (FAKE_ENGINE_LORA_FAIL)"


class Lora:
    """The adapters one fake engine holds, and its LoRA routes."""

    def __init__(self, settings: Settings, labels: str) -> None:
        self.settings = settings
        self.labels = labels
        #: Loaded adapters: name -> path.
        self.loaded: dict[str, str] = {}
        self.loads: Counter[str] = Counter()
        self.unloads: Counter[str] = Counter()
        self.requests: Counter[str] = Counter()
        self._locks: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        self._words: dict[str, tuple[str, list[int], list[str]]] = {}

    def add_routes(self, app: web.Application) -> None:
        if not self.settings.runtime_lora:
            return
        app.router.add_route("POST", "/v1/load_lora_adapter", self.load)
        app.router.add_route("POST", "/v1/unload_lora_adapter", self.unload)

    # -- routes --------------------------------------------------------------------------

    async def load(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        name, path = _field(body, "lora_name"), _field(body, "lora_path")
        inplace = body.get("load_inplace") is True
        async with self._locks[name]:
            if not name or not path:
                message = "Both 'lora_name' and 'lora_path' must be provided."
                raise error(400, message, "InvalidUserInput", None)
            if name in self.settings.served_names:
                message = f"The lora adapter '{name}' conflicts with a served base model."
                raise error(400, message, "InvalidUserInput", None)
            if not inplace and name in self.loaded:
                message = (
                    f"The lora adapter '{name}' has already been loaded. If you want to load"
                    " the adapter in place, set 'load_inplace' to True."
                )
                raise error(400, message, "InvalidUserInput", None)
            if self.settings.lora_load_delay > 0:
                await asyncio.sleep(self.settings.lora_load_delay)
            self._check_loadable(name, path)
            self.loaded[name] = path
            self.loads[name] += 1
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    def _check_loadable(self, name: str, path: str) -> None:
        if not self.settings.enable_lora:
            message = "LoRA is not enabled. Use --enable-lora to enable LoRA."
            raise error(500, message, "InternalServerError", None)
        try:
            with open(os.path.join(path, "adapter_config.json")) as f:
                config = json.load(f)
        except (OSError, ValueError):
            message = f"Loading lora {name} failed: No adapter found for {path}"
            raise error(404, message, "NotFoundError", None) from None
        ranks = [config.get("r", 8), *(config.get("rank_pattern") or {}).values()]
        rank = max(int(r) for r in ranks)
        if rank > self.settings.max_lora_rank:
            message = (
                f"LoRA rank {rank} is greater than max_lora_rank {self.settings.max_lora_rank}."
            )
            raise error(500, message, "InternalServerError", None)
        if name in self.settings.lora_fail:
            raise error(500, FAIL_MESSAGE.format(name=name), "InternalServerError", None)

    async def unload(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        name = _field(body, "lora_name")
        async with self._locks[name]:
            if not name:
                message = "'lora_name' needs to be provided to unload a LoRA adapter."
                raise error(400, message, "InvalidUserInput", None)
            if name not in self.loaded:
                message = f"The lora adapter '{name}' cannot be found."
                raise error(404, message, "NotFoundError", None)
            del self.loaded[name]
            self.unloads[name] += 1
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")

    # -- what the server asks ------------------------------------------------------------

    def serves(self, name: object) -> bool:
        return isinstance(name, str) and name in self.loaded

    def reply_model(self, body: dict[str, Any], base: str) -> str:
        """The ``model`` of the answer: the adapter a request names (counted), else the base."""
        name = body.get("model")
        if isinstance(name, str) and name in self.loaded:
            self.requests[name] += 1
            return name
        return base

    def words(self, name: str, count: int) -> tuple[str, list[int], list[str]]:
        """An adapter's reply: (its text, word offsets into it, each word as JSON)."""
        cached = self._words.get(name)
        if cached is None or len(cached[2]) < count:
            words = [f"{name}:tok{i} " for i in range(count)]
            offsets = [0]
            for word in words:
                offsets.append(offsets[-1] + len(word))
            cached = self._words[name] = ("".join(words), offsets, [dumps(w) for w in words])
        return cached

    def cards(
        self, created: int, card: Callable[[str, int], dict[str, Any]]
    ) -> list[dict[str, Any]]:
        """vLLM's cards for loaded adapters."""
        base = self.settings.served_names[0]
        out = []
        for name, path in self.loaded.items():
            out.append(card(name, created) | {"root": path, "parent": base, "max_model_len": None})
        return out

    def render_metrics(self) -> str:
        lines = []
        series = (
            ("fake_engine:lora_loads_total", "counter", self.loads),
            ("fake_engine:lora_unloads_total", "counter", self.unloads),
            ("fake_engine:lora_requests_total", "counter", self.requests),
            ("fake_engine:lora_loaded", "gauge", Counter(dict.fromkeys(self.loaded, 1))),
        )
        for metric, kind, values in series:
            lines.append(f"# TYPE {metric} {kind}")
            for name, value in sorted(values.items()):
                escaped = name.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
                lines.append(f'{metric}{{{self.labels},lora_name="{escaped}"}} {float(value)!r}')
        return "\n".join(lines) + "\n"


def _field(body: dict[str, Any], key: str) -> str:
    """A required string field, refused as vLLM's pydantic model does."""
    if key not in body:
        raise validation("missing", ("body", key), "Field required", body)
    value = body[key]
    if not isinstance(value, str):
        raise validation("string_type", ("body", key), "Input should be a valid string", value)
    return value
