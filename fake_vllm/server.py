"""The HTTP surface of the fake engine: aiohttp routes and handlers."""

import asyncio
import os
import signal
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NoReturn

from aiohttp import web
from aiohttp.typedefs import Middleware

from .gpu import DeviceMemory
from .log import log
from .lora import Lora
from .protocol import (
    ApiError,
    Reply,
    SseFormat,
    auth_middleware,
    chat_choice,
    chat_prompt_tokens,
    completion_choice,
    completion_prompt_tokens,
    dumps,
    embedding,
    embedding_inputs,
    error,
    error_middleware,
    int_field,
    json_response,
    read_json,
    request_id,
    stream_flags,
    validation,
)
from .routes_extra import ExtraRoutes
from .settings import (
    CLIENT_MAX_SIZE,
    DONE,
    FINGERPRINT,
    PROMETHEUS_TYPE,
    SLEEP_MODES,
    SSE_HEADERS,
    VERSION,
    Settings,
)
from .simengine import EngineFault
from .state import Engine
from .tokens import completion_logprobs, token_ids

GARBAGE_WORD = "<garbage> "
#: What vLLM's API server answers once its EngineCore died (``EngineDeadError.CLIENT_MESSAGE``,
#: ``v1/engine/exceptions.py:22``), with a 500 (``entrypoints/serve/exception_handling/
#: error_response.py:68-72``), and the error it logs (``v1/engine/exceptions.py:19-21``).
ENGINE_DEAD_MESSAGE = "The server had an error while processing your request."
ENGINE_DEAD_LOG = (
    "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue. See stack trace "
    "(above) for the root cause."
)
#: The exit status of a fake engine whose EngineCore died.
ENGINE_DEAD_CODE = 1


class FakeServer:
    """The HTTP surface of the fake engine."""

    def __init__(self, settings: Settings, gpu: DeviceMemory | None = None) -> None:
        self.settings = settings
        self.engine = Engine(settings, gpu)
        self.lora = Lora(settings, self.engine.metrics.labels)
        self.calls: list[dict[str, Any]] = []
        self.model = settings.served_names[0]
        self.names = frozenset(settings.served_names)
        words = [f"tok{i} " for i in range(settings.tokens)]
        self.token_json = [dumps(word) for word in words]
        self.text = "".join(words)
        self.garbage_json = dumps(GARBAGE_WORD)
        self.offsets = [0]
        for word in words:
            self.offsets.append(self.offsets[-1] + len(word))
        #: The level of the last /sleep, and whether a wake from a level in
        #: ``FAKE_ENGINE_WAKE_CORRUPTS`` broke every answer since (until the process ends).
        self.slept_level = 0
        self.corrupted = False

    def build_app(self) -> web.Application:
        middlewares: list[Middleware] = [error_middleware]
        if self.settings.api_keys:
            middlewares.append(auth_middleware(self.settings.api_keys))
        app = web.Application(middlewares=middlewares, client_max_size=CLIENT_MAX_SIZE)
        add = app.router.add_route
        add("GET", "/health", self.health)
        add("GET", "/ping", self.health)
        add("POST", "/ping", self.health)
        add("GET", "/version", self.version)
        add("GET", "/load", self.load)
        add("GET", "/metrics", self.metrics)
        add("GET", "/v1/models", self.models)
        self.lora.add_routes(app)
        if not self.settings.pooling:
            add("POST", "/v1/chat/completions", self.chat_completions)
            add("POST", "/v1/completions", self.completions)
        if self._serves_embeddings():
            add("POST", "/v1/embeddings", self.embeddings)
        extra = ExtraRoutes(self.engine, self.names, self.model, self.settings.tokens)
        extra.corrupt = lambda: self.corrupted
        extra.add(app, self.settings.pooling, self.settings.pooling_task)
        if self.settings.dev_mode:
            add("POST", "/collective_rpc", self.collective_rpc)
            add("POST", "/reset_prefix_cache", self.reset_prefix_cache)
            add("POST", "/sleep", self.sleep)
            add("POST", "/wake_up", self.wake_up)
            add("GET", "/is_sleeping", self.is_sleeping)
        if self.settings.sim is not None:
            add("GET", "/sim/calls", self.sim_calls)
        return app

    @contextmanager
    def _recorded(self, call: dict[str, Any]) -> Iterator[None]:
        """In sim mode, log a dev-route call in arrival order with the status it got."""
        if self.settings.sim is None:
            yield
            return
        call["status"] = None
        self.calls.append(call)
        try:
            yield
            call["status"] = 200
        except (ApiError, web.HTTPException) as exc:
            call["status"] = exc.status
            raise

    async def sim_calls(self, request: web.Request) -> web.Response:
        return json_response(self.calls)

    async def health(self, request: web.Request) -> web.Response:
        return web.Response()

    async def version(self, request: web.Request) -> web.Response:
        return json_response({"version": VERSION})

    async def load(self, request: web.Request) -> web.Response:
        return json_response({"server_load": 0})

    async def metrics(self, request: web.Request) -> web.Response:
        body = (self.engine.render_metrics() + self.lora.render_metrics()).encode()
        return web.Response(body=body, headers={"Content-Type": PROMETHEUS_TYPE})

    def _model_card(self, name: str, created: int) -> dict[str, Any]:
        permission = {
            "id": f"modelperm-{os.urandom(8).hex()}",
            "object": "model_permission",
            "created": created,
            "allow_create_engine": False,
            "allow_sampling": True,
            "allow_logprobs": True,
            "allow_search_indices": False,
            "allow_view": True,
            "allow_fine_tuning": False,
            "organization": "*",
            "group": None,
            "is_blocking": False,
        }
        return {
            "id": name,
            "object": "model",
            "created": created,
            "owned_by": "vllm",
            "root": self.settings.model,
            "parent": None,
            "max_model_len": self.settings.max_model_len,
            "permission": [permission],
        }

    async def models(self, request: web.Request) -> web.Response:
        created = int(time.time())
        cards = [self._model_card(name, created) for name in self.settings.served_names]
        cards += self.lora.cards(created, self._model_card)
        return json_response({"object": "list", "data": cards})

    def _check_model(self, body: dict[str, Any]) -> None:
        name = body.get("model")
        if name is None or name == "":
            return
        if not isinstance(name, str):
            raise validation(
                "string_type", ("body", "model"), "Input should be a valid string", name
            )
        if name not in self.names and not self.lora.serves(name):
            message = f"The model `{name}` does not exist."
            raise error(404, message, "NotFoundError", "model")

    def _reply(self, request: web.Request, body: dict[str, Any], chat: bool) -> Reply:
        prompts = chat_prompt_tokens(body) if chat else completion_prompt_tokens(body)
        self._check_model(body)
        priority = body.get("priority", 0)
        if type(priority) is not int:
            msg = "Input should be a valid integer"
            raise validation("int_type", ("body", "priority"), msg, priority)
        if priority != 0 and self.settings.scheduling_policy != "priority":
            message = f"Got priority {priority} but Priority scheduling is not enabled."
            raise error(400, message, "BadRequestError", "priority")
        limit_name = (
            "max_completion_tokens" if chat and "max_completion_tokens" in body else "max_tokens"
        )
        limit = int_field(body, limit_name, None if chat else 16)
        n = int_field(body, "n", 1) or 1
        stream, include_usage, continuous = stream_flags(body)
        max_len = self.settings.max_model_len
        longest = max(prompts)
        if longest > max_len:
            message = (
                f"This model's maximum context length is {max_len} tokens. However, your prompt "
                f"contains at least {longest} input tokens, which exceeds this limit even without "
                "any output tokens. Please reduce the length of the input prompt. "
                f"(parameter=input_tokens, value={longest})"
            )
            raise error(400, message, "BadRequestError", "input_tokens")
        if limit is not None and limit > max_len:
            message = (
                f"{limit_name}={limit} cannot be greater than max_model_len={max_len}. Please "
                f"request fewer output tokens. (parameter={limit_name}, value={limit})"
            )
            raise error(400, message, "BadRequestError", limit_name)
        cap = max_len - longest if limit is None else min(limit, max_len - longest)
        tokens = min(cap, self.settings.tokens)
        prefix = "chatcmpl-" if chat else "cmpl-"
        return Reply(
            chat=chat,
            rid=prefix + request_id(request, body),
            model=self.lora.reply_model(body, self.model),
            created=int(time.time()),
            stream=stream,
            choices=n * len(prompts),
            tokens=tokens,
            finish="length" if tokens == cap else "stop",
            prompt_tokens=sum(prompts),
            include_usage=include_usage,
            continuous_usage=continuous,
            arrival=self.engine.loop.time(),
            logprobs=None if chat else int_field(body, "logprobs", None),
            token_ids=body.get("return_token_ids") is True,
        )

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        reply = self._reply(request, await read_json(request), chat)
        engine = self.engine
        engine.enter()
        epoch = None
        try:
            epoch = await engine.admit(reply.kv_tokens)
            if epoch is not None:
                await self._step(request)
                engine.started += 1
                crash_after = self.settings.crash_after
                reply.crash = crash_after is not None and engine.started > crash_after
                stall_after = self.settings.stall_after
                reply.stall = stall_after is not None and engine.started > stall_after
                reply.garbage = engine.weights_lost or self.corrupted
                if reply.garbage:
                    engine.metrics.garbage_completions += 1
            if reply.crash and not reply.stream:
                self._crash()
            if reply.stall and not reply.stream:
                await asyncio.Event().wait()  # a decode stall: never answers, health still 200
            if reply.stream:
                return await self._stream(request, reply, epoch)
            return await self._complete(reply, epoch)
        finally:
            engine.leave(epoch is not None, reply.kv_tokens)

    async def _step(self, request: web.Request) -> None:
        """Run the engine's forward pass; when it faults, die as vLLM's EngineCore does."""
        try:
            await self.engine.step()
        except EngineFault as exc:
            await self._die(request, exc)

    async def _die(self, request: web.Request, fault: EngineFault) -> NoReturn:
        """vLLM's EngineCore dies on an exception in its busy loop ("EngineCore encountered a
        fatal error.", ``v1/engine/core.py:1582-1587``); the API server answers the request
        500 and shuts down (``entrypoints/serve/exception_handling/handlers/vllm_error.py:
        61-66``). The simulated memory goes with the EngineCore."""
        log("EngineCore encountered a fatal error.", "ERROR", sys.stderr)
        print(str(fault), file=sys.stderr)
        print(ENGINE_DEAD_LOG, file=sys.stderr, flush=True)
        response = json_response(
            {
                "error": {
                    "message": ENGINE_DEAD_MESSAGE,
                    "type": "InternalServerError",
                    "param": None,
                    "code": 500,
                }
            },
            status=500,
        )
        await response.prepare(request)
        await response.write_eof()
        sim = self.engine.sim
        if sim is not None:
            sim.release()
            if sim.owner != os.getpid():
                os.kill(sim.owner, signal.SIGKILL)
        os._exit(ENGINE_DEAD_CODE)

    def _crash(self) -> NoReturn:
        message = "EngineCore encountered an issue (fake crash: FAKE_ENGINE_CRASH_AFTER)."
        log(message, "ERROR", sys.stderr)
        print("RuntimeError: EngineCore died unexpectedly (fake)", file=sys.stderr, flush=True)
        os._exit(self.settings.crash_code)

    def _record(self, reply: Reply, reason: str) -> None:
        now = self.engine.loop.time()
        ttft = None if reply.first_token_at is None else reply.first_token_at - reply.arrival
        generated = reply.produced * reply.choices
        self.engine.metrics.record(
            reply.prompt_tokens, generated, reason, ttft, now - reply.arrival
        )

    def _usage(self, reply: Reply) -> dict[str, Any]:
        completion = reply.produced * reply.choices
        return {
            "prompt_tokens": reply.prompt_tokens,
            "total_tokens": reply.prompt_tokens + completion,
            "completion_tokens": completion,
            "prompt_tokens_details": None,
            "completion_tokens_details": None,
        }

    async def _run_all_tokens(self, reply: Reply, epoch: int | None) -> str:
        engine = self.engine
        if epoch is None:
            return "abort"
        delay = self.settings.token_delay
        start = engine.loop.time()
        if delay > 0 and reply.tokens > 0:
            await engine.pause(delay * reply.tokens)
        await engine.hold()
        if engine.epoch != epoch or engine.stopping:
            elapsed = engine.loop.time() - start
            reply.produced = min(reply.tokens, int(elapsed / delay)) if delay > 0 else 0
            reason = "abort"
        else:
            reply.produced = reply.tokens
            reason = reply.finish
        if reply.produced:
            reply.first_token_at = start + delay
        return reason

    async def _complete(self, reply: Reply, epoch: int | None) -> web.Response:
        reason = await self._run_all_tokens(reply, epoch)
        if reply.garbage:
            text = GARBAGE_WORD * reply.produced
        elif reply.model != self.model:  # a LoRA adapter's own words
            text, offsets, _ = self.lora.words(reply.model, reply.tokens)
            text = text[: offsets[reply.produced]]
        else:
            text = self.text[: self.offsets[reply.produced]]
        self._record(reply, reason)
        if reply.chat:
            choices = [chat_choice(i, text, reason) for i in range(reply.choices)]
            body = {"id": reply.rid, "object": "chat.completion", "created": reply.created}
        else:
            choices = [completion_choice(i, text, reason) for i in range(reply.choices)]
            self._add_tokens(choices, reply)
            body = {"id": reply.rid, "object": "text_completion", "created": reply.created}
        body |= {
            "model": reply.model,
            "choices": choices,
            "service_tier": None,
            "system_fingerprint": FINGERPRINT,
            "usage": self._usage(reply),
        }
        if reply.chat:
            body |= {"prompt_logprobs": None, "prompt_token_ids": None, "prompt_text": None}
        body |= {"kv_transfer_params": None, "ec_transfer_params": None, "metrics": None}
        return json_response(body)

    async def _stream(
        self, request: web.Request, reply: Reply, epoch: int | None
    ) -> web.StreamResponse:
        response = web.StreamResponse(headers=SSE_HEADERS)
        await response.prepare(request)
        sse = SseFormat(reply)
        reason = "abort"
        try:
            if reply.chat:
                usage = "," + sse.usage(0) if reply.continuous_usage else ""
                for index in range(reply.choices):
                    await response.write(sse.role(index, usage))
            if epoch is not None:
                reason = await self._stream_tokens(response, sse, reply, epoch)
            await self._end_stream(response, sse, reply, reason)
        except ConnectionError:
            reason = "abort"
        self._record(reply, reason)
        return response

    async def _stream_tokens(
        self, response: web.StreamResponse, sse: SseFormat, reply: Reply, epoch: int
    ) -> str:
        engine = self.engine
        delay = self.settings.token_delay
        crash_at = min(2, reply.tokens - 1) if reply.crash else -1
        stall_at = min(2, reply.tokens - 1) if reply.stall else -1
        words = self.token_json
        if reply.model != self.model:  # a LoRA adapter's own words
            words = self.lora.words(reply.model, reply.tokens)[2]
        for t in range(reply.tokens):
            if delay > 0:
                await engine.pause(delay)
            await engine.hold()
            if engine.epoch != epoch or engine.stopping:
                return "abort"
            if t == crash_at:
                self._crash()
            if t == stall_at:
                await asyncio.Event().wait()  # a decode stall: health still 200
            finish = reply.finish if t + 1 == reply.tokens else None
            usage = "," + sse.usage(t + 1) if reply.continuous_usage else ""
            chunk = sse.token
            word = self.garbage_json if reply.garbage else words[t]
            for index in range(reply.choices):
                await response.write(chunk(index, word, finish, usage))
            if t == 0:
                reply.first_token_at = engine.loop.time()
            reply.produced = t + 1
        if reply.crash:
            self._crash()
        return reply.finish

    async def _end_stream(
        self, response: web.StreamResponse, sse: SseFormat, reply: Reply, reason: str
    ) -> None:
        if reason == "abort" and self.engine.stopping:
            await response.write(DONE)
            return
        if reason == "abort" or reply.tokens == 0:
            usage = "," + sse.usage(reply.produced) if reply.continuous_usage else ""
            for index in range(reply.choices):
                await response.write(sse.token(index, '""', reason, usage))
        if reply.include_usage:
            await response.write(sse.usage_chunk(reply.produced * reply.choices))
        await response.write(DONE)

    async def embeddings(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        inputs = embedding_inputs(body)
        self._check_model(body)
        encoding = body.get("encoding_format") or "float"
        if encoding not in ("float", "base64"):
            msg = "Input should be 'float' or 'base64'"
            raise validation("literal_error", ("body", "encoding_format"), msg, encoding)
        engine = self.engine
        engine.enter()
        epoch = None
        try:
            epoch = await engine.admit(0)
            if epoch is not None:
                await self._step(request)
        finally:
            engine.leave(epoch is not None, 0)
        if epoch is None:
            raise error(503, "The server is shutting down.", "ServiceUnavailableError", None)
        tokens = sum(count for _, count in inputs)
        engine.metrics.record(tokens, 0, "stop", None, 0.0)
        data = [
            {"index": i, "object": "embedding", "embedding": embedding(self._key(key), encoding)}
            for i, (key, _) in enumerate(inputs)
        ]
        usage = {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0}
        return json_response(
            {
                "id": f"embd-{request_id(request, body)}",
                "object": "list",
                "created": int(time.time()),
                "model": self.model,
                "data": data,
                "usage": usage | {"prompt_tokens_details": None},
            }
        )

    async def sleep(self, request: web.Request) -> web.Response:
        raw_level = request.query.get("level", "1")
        try:
            level = int(raw_level)
        except ValueError:
            msg = "Input should be a valid integer, unable to parse string as an integer"
            raise validation("int_parsing", ("query", "level"), msg, raw_level) from None
        if not 0 <= level <= 2:
            kind, msg = ("greater_than_equal", "greater than or equal to 0")
            if level > 2:
                kind, msg = ("less_than_equal", "less than or equal to 2")
            raise validation(kind, ("query", "level"), f"Input should be {msg}", raw_level)
        mode = request.query.get("mode", "abort")
        if mode not in SLEEP_MODES:
            msg = "Input should be 'abort', 'wait' or 'keep'"
            raise validation("literal_error", ("query", "mode"), msg, mode)
        with self._recorded({"call": "sleep", "level": level}):
            await self.engine.sleep(level, mode)
        self.slept_level = level
        return json_response({"status": "sleeping", "level": level})

    async def wake_up(self, request: web.Request) -> web.Response:
        tags = request.query.getall("tags", []) or None
        with self._recorded({"call": "wake_up", "tags": tags}):
            awake = await self.engine.wake_up(tags)
        self._corrupt_on_wake(awake)
        return json_response({"status": "awake" if awake else "sleeping", "tags": tags})

    async def is_sleeping(self, request: web.Request) -> web.Response:
        return json_response({"is_sleeping": self.engine.paused})

    async def collective_rpc(self, request: web.Request) -> web.Response:
        body = await read_json(request, check_type=False)
        if not isinstance(body.get("method"), str):
            raise error(400, "Missing 'method' in request body", "BadRequestError", "method")
        with self._recorded({"call": "collective_rpc", "method": body["method"]}):
            if body["method"] == "reload_weights":
                await self.engine.reload_weights()
        return json_response({"results": [None] * self.settings.tensor_parallel_size})

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        self.engine.metrics.reset_prefix_cache += 1
        return json_response({"success": True})

    # -- wrong answers after a wake (FAKE_ENGINE_WAKE_CORRUPTS), token ids and logprobs ---------

    def _corrupt_on_wake(self, awake: bool) -> None:
        """A full wake from a level in ``FAKE_ENGINE_WAKE_CORRUPTS`` breaks every answer."""
        if awake and self.slept_level in self.settings.wake_corrupts:
            self.corrupted = True

    def _key(self, key: str) -> str:
        """What a pooling answer is computed from: another key once corrupted."""
        return key + "\0corrupted" if self.corrupted else key

    def _serves_embeddings(self) -> bool:
        """/v1/embeddings: vLLM serves it for the embed and token_embed tasks only (here also
        for generating models and an unnamed pooling task, as before)."""
        task = self.settings.pooling_task
        return task is None or task in ("embed", "token_embed", "embed&token_classify")

    def _add_tokens(self, choices: list[dict[str, Any]], reply: Reply) -> None:
        """A completion's ``token_ids`` and ``logprobs`` when the request asked for them."""
        if reply.logprobs is None and not reply.token_ids:
            return
        garbage = reply.garbage
        words = [GARBAGE_WORD if garbage else f"tok{i} " for i in range(reply.produced)]
        for choice in choices:
            if reply.token_ids:
                choice["token_ids"] = token_ids(reply.produced, garbage)
            if reply.logprobs is not None:
                choice["logprobs"] = completion_logprobs(words, reply.logprobs, garbage)
