"""vLLM's other routes that name a model: the Anthropic Messages API, pooling, scoring and
Cohere embeddings, speech to text (form uploads) and the realtime WebSocket.

Answers have the shapes of vLLM 0.33's protocol classes (``entrypoints/anthropic/protocol.py``,
``entrypoints/pooling/*/protocol.py``, ``entrypoints/speech_to_text/*/protocol.py``); the
numbers in them are made up, the same for the same input. As in vLLM, a generating model serves
the Messages, speech and realtime routes, a pooling model the pooling and scoring ones.

``FAKE_ENGINE_UPLOAD_LOG=PATH``: each upload is appended to PATH as a JSON line (its length,
framing, SHA-256 and form fields), so a test can check that the engine got the client's bytes.
"""

import base64
import email.message
import hashlib
import json
import math
import os
import time
from collections.abc import Callable
from typing import Any

from aiohttp import WSMsgType, web

from .protocol import (
    dumps,
    embedding,
    embedding_inputs,
    error,
    int_field,
    json_response,
    read_json,
    request_id,
    validation,
)
from .settings import DONE, SSE_HEADERS
from .state import Engine

#: vLLM's ``VLLM_MAX_AUDIO_CLIP_FILESIZE_MB`` default.
MAX_AUDIO_MB = 25
#: The audio a fake transcription pretends the bytes hold: 16 kHz 16-bit mono.
AUDIO_BYTES_PER_S = 32000
AUDIO_FORMATS = ("json", "text", "verbose_json", "diarized_json")


class ExtraRoutes:
    """The routes, for one fake engine (`FakeServer` hands over what they need)."""

    def __init__(self, engine: Engine, names: frozenset[str], model: str, tokens: int) -> None:
        self.engine = engine
        self.names = names
        self.model = model
        #: What the engine says, a word per token (as the completion routes).
        self.words = [f"tok{i} " for i in range(tokens)]
        #: Whether a wake broke the engine's answers (the server's ``corrupted``).
        self.corrupt: Callable[[], bool] = lambda: False

    def add(self, app: web.Application, pooling: bool, task: str | None = None) -> None:
        """The routes; a pooling model's by its `task` (None: all of them): /classify only
        for ``classify``, as vLLM (``entrypoints/pooling/factories.py:110-143``)."""
        add = app.router.add_route
        if pooling:
            add("POST", "/pooling", self.pooling)
            if task in (None, "classify"):
                add("POST", "/classify", self.classify)
            add("POST", "/v2/embed", self.cohere_embed)
            for path in ("/score", "/v1/score"):
                add("POST", path, self.score)
            for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
                add("POST", path, self.rerank)
            return
        add("POST", "/v1/messages", self.messages)
        add("POST", "/v1/messages/count_tokens", self.count_tokens)
        add("POST", "/v1/audio/transcriptions", self.transcriptions)
        add("POST", "/v1/audio/translations", self.translations)
        add("GET", "/v1/realtime", self.realtime)

    # -- shared ---------------------------------------------------------------------------

    def _check_model(self, name: object) -> None:
        if name is None or name == "":
            return
        if not isinstance(name, str):
            raise validation(
                "string_type", ("body", "model"), "Input should be a valid string", name
            )
        if name not in self.names:
            raise error(404, f"The model `{name}` does not exist.", "NotFoundError", "model")

    async def _admit(self) -> None:
        """Take a turn on the engine (parked while it sleeps; 503 while it stops)."""
        engine = self.engine
        engine.enter()
        epoch = None
        try:
            epoch = await engine.admit(0)
        finally:
            engine.leave(epoch is not None, 0)
        if epoch is None:
            raise error(503, "The server is shutting down.", "ServiceUnavailableError", None)

    def _key(self, key: str) -> str:
        """What a pooling answer is computed from: another key once a wake broke the engine."""
        return key + "\0corrupted" if self.corrupt() else key

    def _text(self, tokens: int) -> str:
        return "".join(self.words[:tokens])

    @staticmethod
    def _usage(prompt: int, completion: int = 0) -> dict[str, Any]:
        return {
            "prompt_tokens": prompt,
            "total_tokens": prompt + completion,
            "completion_tokens": completion,
            "prompt_tokens_details": None,
        }

    # -- Anthropic Messages ---------------------------------------------------------------

    @staticmethod
    def _message_tokens(body: dict[str, Any]) -> int:
        messages = body.get("messages")
        if not isinstance(messages, list):
            raise validation("missing", ("body", "messages"), "Field required", body)
        words = 0
        for message in messages:
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, str):
                words += len(content.split())
            elif isinstance(content, list):
                texts = (b.get("text") for b in content if isinstance(b, dict))
                words += sum(len(t.split()) for t in texts if isinstance(t, str))
        return max(1, words)

    async def messages(self, request: web.Request) -> web.StreamResponse:
        body = await read_json(request)
        self._check_model(body.get("model"))
        prompt = self._message_tokens(body)
        limit = int_field(body, "max_tokens", None)
        if limit is None:
            raise validation("missing", ("body", "max_tokens"), "Field required", body)
        await self._admit()
        tokens = min(limit, len(self.words))
        stop = "max_tokens" if tokens == limit else "end_turn"
        rid = f"msg_{request_id(request, body)}"
        self.engine.metrics.record(
            prompt, tokens, "length" if stop == "max_tokens" else "stop", None, 0.0
        )
        if body.get("stream") is True:
            return await self._message_stream(request, rid, prompt, tokens, stop)
        return json_response(
            {
                "id": rid,
                "type": "message",
                "role": "assistant",
                "content": [{"type": "text", "text": self._text(tokens)}],
                "model": self.model,
                "stop_reason": stop,
                "stop_sequence": None,
                "usage": {"input_tokens": prompt, "output_tokens": tokens},
                "kv_transfer_params": None,
                "ec_transfer_params": None,
            }
        )

    async def _message_stream(
        self, request: web.Request, rid: str, prompt: int, tokens: int, stop: str
    ) -> web.StreamResponse:
        response = web.StreamResponse(headers=SSE_HEADERS)
        await response.prepare(request)

        async def event(name: str, data: dict[str, Any]) -> None:
            await response.write(f"event: {name}\ndata: {dumps(data)}\n\n".encode())

        start: dict[str, Any] = {
            "id": rid,
            "type": "message",
            "role": "assistant",
            "content": [],
            "model": self.model,
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": prompt, "output_tokens": 0},
        }
        await event("message_start", {"type": "message_start", "message": start})
        block = {"type": "text", "text": ""}
        await event(
            "content_block_start",
            {"type": "content_block_start", "index": 0, "content_block": block},
        )
        for word in self.words[:tokens]:
            delta = {"type": "text_delta", "text": word}
            await event(
                "content_block_delta", {"type": "content_block_delta", "index": 0, "delta": delta}
            )
        await event("content_block_stop", {"type": "content_block_stop", "index": 0})
        usage = {"input_tokens": prompt, "output_tokens": tokens}
        end = {"stop_reason": stop, "stop_sequence": None}
        await event("message_delta", {"type": "message_delta", "delta": end, "usage": usage})
        await event("message_stop", {"type": "message_stop"})
        return response

    async def count_tokens(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        self._check_model(body.get("model"))
        return json_response({"input_tokens": self._message_tokens(body)})

    # -- pooling and scoring --------------------------------------------------------------

    async def _pooled(self, request: web.Request) -> tuple[dict[str, Any], list[tuple[str, int]]]:
        body = await read_json(request)
        inputs = embedding_inputs(body)
        self._check_model(body.get("model"))
        await self._admit()
        self.engine.metrics.record(sum(n for _, n in inputs), 0, "stop", None, 0.0)
        return body, inputs

    async def pooling(self, request: web.Request) -> web.Response:
        body, inputs = await self._pooled(request)
        tokens = sum(n for _, n in inputs)
        data = [
            {"index": i, "object": "pooling", "data": embedding(self._key(key), "float")}
            for i, (key, _) in enumerate(inputs)
        ]
        return json_response(
            {
                "id": f"pooling-{request_id(request, body)}",
                "object": "list",
                "created": int(time.time()),
                "model": self.model,
                "data": data,
                "usage": self._usage(tokens),
            }
        )

    async def classify(self, request: web.Request) -> web.Response:
        body, inputs = await self._pooled(request)
        tokens = sum(n for _, n in inputs)
        data = []
        for i, (key, _) in enumerate(inputs):
            p = _unit(self._key(key))
            label = "LABEL_1" if p >= 0.5 else "LABEL_0"
            data.append({"index": i, "label": label, "probs": [1 - p, p], "num_classes": 2})
        return json_response(
            {
                "id": f"classify-{request_id(request, body)}",
                "object": "list",
                "created": int(time.time()),
                "model": self.model,
                "data": data,
                "usage": self._usage(tokens),
            }
        )

    async def cohere_embed(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        self._check_model(body.get("model"))
        texts = body.get("texts")
        if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
            raise error(
                400, "Either 'texts' or 'inputs' must be provided.", "BadRequestError", None
            )
        await self._admit()
        tokens = sum(max(1, len(t.split())) for t in texts)
        vectors = [embedding(t, "float") for t in texts]
        return json_response(
            {
                "id": f"embd-{request_id(request, body)}",
                "embeddings": {"float": vectors},
                "texts": texts,
                "meta": {"api_version": {"version": "2"}, "billed_units": {"input_tokens": tokens}},
                "response_type": "embeddings_by_type",
            }
        )

    async def score(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        self._check_model(body.get("model"))
        for first, second in (
            ("queries", "documents"),
            ("queries", "items"),
            ("data_1", "data_2"),
            ("text_1", "text_2"),
        ):
            if first in body and second in body:
                break
        else:
            raise validation("missing", ("body", "queries"), "Field required", body)
        left, right = _texts(body[first], first), _texts(body[second], second)
        await self._admit()
        pairs = [(left[0] if len(left) == 1 else left[i], text) for i, text in enumerate(right)]
        tokens = sum(len(a.split()) + len(b.split()) for a, b in pairs)
        data = [
            {"index": i, "object": "score", "score": _unit(a + "\0" + b)}
            for i, (a, b) in enumerate(pairs)
        ]
        return json_response(
            {
                "id": f"score-{request_id(request, body)}",
                "object": "list",
                "created": int(time.time()),
                "model": self.model,
                "data": data,
                "usage": self._usage(tokens),
            }
        )

    async def rerank(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        self._check_model(body.get("model"))
        query = body.get("query")
        if not isinstance(query, str):
            raise validation("missing", ("body", "query"), "Field required", body)
        documents = _texts(body.get("documents"), "documents")
        top_n = int_field(body, "top_n", None) or len(documents)
        await self._admit()
        scored = [(i, d, _unit(query + "\0" + d)) for i, d in enumerate(documents)]
        scored.sort(key=lambda item: -item[2])
        tokens = sum(len(query.split()) + len(d.split()) for d in documents)
        results = [
            {"index": i, "document": {"text": d, "multi_modal": None}, "relevance_score": s}
            for i, d, s in scored[:top_n]
        ]
        return json_response(
            {
                "id": f"score-{request_id(request, body)}",
                "model": self.model,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
                "results": results,
            }
        )

    # -- speech to text -------------------------------------------------------------------

    async def transcriptions(self, request: web.Request) -> web.StreamResponse:
        return await self._speech(request, "transcription")

    async def translations(self, request: web.Request) -> web.StreamResponse:
        return await self._speech(request, "translation")

    async def _speech(self, request: web.Request, task: str) -> web.StreamResponse:
        raw = await request.read()  # (the engine may hold the upload: vLLM does)
        fields, files = parse_form(raw, request.headers.get("Content-Type", ""))
        _log_upload(request, raw, fields, files)
        if "file" not in files:
            raise validation("missing", ("body", "file"), "Field required", None)
        self._check_model(fields.get("model"))
        audio = files["file"]
        limit = float(os.environ.get("VLLM_MAX_AUDIO_CLIP_FILESIZE_MB", MAX_AUDIO_MB))
        if len(audio) > limit * 1024 * 1024:
            message = "Maximum file size exceeded (parameter=audio_filesize_mb, value=%g)"
            raise error(400, message % (len(audio) / 2**20), "BadRequestError", "audio_filesize_mb")
        if not audio:
            raise error(400, "Can't process empty audio.", "BadRequestError", None)
        response_format = fields.get("response_format", "json")
        if response_format not in AUDIO_FORMATS:
            message = (
                "Currently only support response_format: `text`, `json`, `verbose_json` or "
                "`diarized_json`"
            )
            raise error(400, message, "BadRequestError", None)
        await self._admit()
        seconds = len(audio) / AUDIO_BYTES_PER_S
        tokens = min(len(self.words), max(1, math.ceil(seconds)))
        self.engine.metrics.record(tokens, tokens, "stop", None, 0.0)
        if fields.get("stream", "false").lower() == "true":
            include = fields.get("stream_include_usage", "false").lower() == "true"
            return await self._speech_stream(request, task, tokens, include)
        text = self._text(tokens).strip()
        if task == "translation":
            return json_response({"text": text})
        return json_response(
            {"text": text, "usage": {"type": "duration", "seconds": math.ceil(seconds)}}
        )

    async def _speech_stream(
        self, request: web.Request, task: str, tokens: int, include_usage: bool
    ) -> web.StreamResponse:
        response = web.StreamResponse(headers=SSE_HEADERS)
        await response.prepare(request)
        prefix, obj = (
            ("trsc", "transcription.chunk")
            if task == "transcription"
            else ("trsl", "translation.chunk")
        )
        head = {
            "id": f"{prefix}-{os.urandom(16).hex()}",
            "object": obj,
            "created": int(time.time()),
            "model": self.model,
        }
        for i, word in enumerate(self.words[:tokens]):
            last = i + 1 == tokens
            choice: dict[str, Any] = {
                "delta": {"content": word},
                "finish_reason": "stop" if last else None,
                "stop_reason": None,
            }
            await response.write(b"data: %s\n\n" % dumps({**head, "choices": [choice]}).encode())
        if include_usage:
            chunk = {**head, "choices": [], "usage": self._usage(tokens, tokens)}
            await response.write(b"data: %s\n\n" % dumps(chunk).encode())
        await response.write(DONE)
        return response

    # -- realtime -------------------------------------------------------------------------

    async def realtime(self, request: web.Request) -> web.WebSocketResponse:
        """``connection.py``'s protocol: ``session.created``; ``session.update`` validates the
        model; ``input_audio_buffer.commit`` starts a transcription, each append after it
        gets a ``transcription.delta``, a ``commit`` with ``final`` ends it
        (``transcription.done``)."""
        ws = web.WebSocketResponse(max_msg_size=64 * 1024 * 1024)
        await ws.prepare(request)
        created = {
            "type": "session.created",
            "id": f"sess-{os.urandom(16).hex()}",
            "created": int(time.time()),
        }
        await ws.send_str(dumps(created))
        validated = started = False
        said: list[str] = []
        audio = 0

        async def fail(message: str, code: str) -> None:
            await ws.send_str(dumps({"type": "error", "error": message, "code": code}))

        async for msg in ws:
            if msg.type != WSMsgType.TEXT:
                continue
            try:
                event = json.loads(msg.data)
            except ValueError:
                await fail("Invalid JSON", "invalid_json")
                continue
            kind = event.get("type") if isinstance(event, dict) else None
            if kind == "session.update":
                model = event.get("model")
                if model is None:
                    await fail("Missing required field: model", "invalid_event")
                elif model not in self.names:
                    await fail(f"The model `{model}` does not exist.", "model_not_found")
                else:
                    validated = True
            elif kind == "input_audio_buffer.append":
                try:
                    chunk = base64.b64decode(event.get("audio", ""), validate=True)
                except ValueError:
                    chunk = b""
                if not chunk:
                    await fail("Invalid audio data", "invalid_audio")
                    continue
                audio += len(chunk)
                if started:
                    word = self.words[len(said) % len(self.words)] if self.words else ""
                    said.append(word)
                    await ws.send_str(dumps({"type": "transcription.delta", "delta": word}))
            elif kind == "input_audio_buffer.commit":
                if not validated:
                    await fail(
                        "Model not validated. Make sure to validate the model by "
                        "sending a session.update event.",
                        "model_not_validated",
                    )
                elif event.get("final") is True:
                    prompt = max(1, audio // AUDIO_BYTES_PER_S)
                    usage = self._usage(prompt, len(said))
                    done = {"type": "transcription.done", "text": "".join(said), "usage": usage}
                    await ws.send_str(dumps(done))
                    started, said, audio = False, [], 0
                else:
                    started = True
            else:
                await fail(f"Unknown event type: {kind}", "unknown_event")
        return ws


def _unit(key: str) -> float:
    """A number in [0, 1) that depends only on `key`."""
    digest = hashlib.blake2b(key.encode(), digest_size=4).digest()
    return int.from_bytes(digest, "big") / 2**32


def _texts(value: object, field: str) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return value
    msg = "Input should be a valid string or a list of strings"
    raise validation("union_type", ("body", field), msg, value)


def parse_form(raw: bytes, content_type: str) -> tuple[dict[str, str], dict[str, bytes]]:
    """A ``multipart/form-data`` body's fields and files (the last of a name wins, as in
    Starlette); a 400 as vLLM's validation errors for a body that is not one."""
    header = email.message.Message()
    header["Content-Type"] = content_type
    boundary = header.get_param("boundary")
    if header.get_content_type() != "multipart/form-data" or not isinstance(boundary, str):
        raise validation("missing", ("body", "file"), "Field required", None)
    delimiter = b"\r\n--" + boundary.encode("latin-1")
    fields: dict[str, str] = {}
    files: dict[str, bytes] = {}
    segments = (b"\r\n" + raw).split(delimiter)
    for segment in segments[1:]:
        if segment.startswith(b"--"):
            break
        head, sep, content = segment.partition(b"\r\n\r\n")
        if not sep:
            raise error(400, "Malformed multipart body", "BadRequestError", None)
        part = email.message.Message()
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.decode("latin-1").partition(":")
            part[name.strip()] = value.strip()
        field = part.get_param("name", header="content-disposition")
        if not isinstance(field, str):
            continue
        if part.get_param("filename", header="content-disposition") is not None:
            files[field] = content
        else:
            fields[field] = content.decode("utf-8", "replace")
    else:
        raise error(400, "Malformed multipart body: no closing boundary", "BadRequestError", None)
    return fields, files


def _log_upload(
    request: web.Request, raw: bytes, fields: dict[str, str], files: dict[str, bytes]
) -> None:
    path = os.environ.get("FAKE_ENGINE_UPLOAD_LOG")
    if not path:
        return
    entry = {
        "path": request.path,
        "content_type": request.headers.get("Content-Type"),
        "content_length": request.headers.get("Content-Length"),
        "chunked": "chunked" in request.headers.get("Transfer-Encoding", "").lower(),
        "length": len(raw),
        "sha256": hashlib.sha256(raw).hexdigest(),
        "fields": fields,
        "files": {
            name: {"length": len(data), "sha256": hashlib.sha256(data).hexdigest()}
            for name, data in files.items()
        },
    }
    with open(path, "a") as log:
        log.write(json.dumps(entry) + "\n")
