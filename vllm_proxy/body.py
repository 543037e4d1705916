"""Request bodies: find the ``model`` a JSON request names, and give the engine its bytes.

A small body is parsed whole with `json.loads`, as it always was. A large one (a chat request
with base64 images, a long document) is scanned instead: `scan` walks the top-level object
token by token, jumping over string contents with `bytes.find` rather than decoding them, and
reads only the ``model`` value. Parsing a 10 MB request with one base64 image took 12 ms of the
proxy's time per request; the scan takes 0.4 ms. The bytes are forwarded as received;
for an alias only the model value is replaced, in place.

The scan checks what it walks as strictly as the parser: the grammar of every token at every
depth, numbers and literals (``NaN`` and ``Infinity`` included, as `json.loads` takes them),
every string's bounds, the contents of every string under 64 KiB (escapes, control
characters), UTF-8, the nesting depth, and nothing after the object. The contents of a longer
string (the base64 image itself) are not looked at: a bad escape or a raw control character in
one reaches the engine, which rejects the body itself. Whenever the scan cannot decide (not
an object, anything invalid, a non-string ``model``, too many tokens for its size, too deep),
the body is parsed with `json.loads`, whose answer (and error message) is the one the client
gets. Duplicate keys
behave as in `json.loads`: the last ``model`` wins, and that is the one replaced for an alias.
"""

from __future__ import annotations

import json
import re
from collections.abc import Generator
from typing import Any

from .errors import BadRequest

#: Bodies from this size on are scanned rather than parsed whole.
SCAN_MIN_BYTES = 256 * 1024
#: Strings shorter than this are checked whole (escapes, control characters) by json's own
#: string scanner; longer ones only for their bounds.
CHECK_STRINGS_BELOW = 64 * 1024
#: The scan reads at most `MIN_TOKENS` tokens and one more per this many bytes of body: a
#: denser body (an array of numbers, thousands of short messages) is parsed by `json.loads`
#: instead, which is faster per token than a loop in Python (about 0.07 vs 0.7 µs here).
BYTES_PER_TOKEN = 512
MIN_TOKENS = 1024
#: Deeper nesting is left to `json.loads` (which refuses it past its recursion limit).
MAX_DEPTH = 256

#: A request body: bytes, or the buffer a large one was read into.
Body = bytes | bytearray

_TOKEN = re.compile(
    rb"[ \t\n\r]*(?:"
    rb"([{}\[\],:])"  # 1: structure
    rb'|(")'  # 2: a string opens
    rb"|(-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?|true|false|null|NaN|-?Infinity)"
    rb")"
)
_END = re.compile(rb"[ \t\n\r]*\Z")
_scanstring: Any = json.decoder.scanstring  # type: ignore[attr-defined]

#: A token is read as final only with more than this many bytes after it in: ``1.`` and
#: ``1e+`` read as the number ``1`` until the digit after them has come.
_SETTLED = 2

_LBRACE, _RBRACE, _LBRACK, _RBRACK, _COMMA, _COLON = b"{}[],:"
_BACKSLASH, _QUOTE = 0x5C, 0x22
# What the scan expects next.
_VALUE, _VALUE_OR_END, _KEY, _KEY_OR_END, _COLON_NEXT, _COMMA_OR_END = range(6)


class _Undecided(Exception):
    """The scan cannot answer; `json.loads` will."""


class Found:
    """What `scan` found: the top-level ``model`` (its last occurrence), where its value is,
    where the object opens, and whether its top-level ``stream`` is ``true``."""

    __slots__ = ("brace", "empty", "model", "span", "stream")

    def __init__(
        self,
        model: str | None,
        span: tuple[int, int] | None,
        brace: int,
        empty: bool,
        stream: bool = False,
    ) -> None:
        self.model = model
        self.span = span
        self.brace = brace
        self.empty = empty
        self.stream = stream

    def with_model(self, body: Body, name: str) -> Body:
        """`body` with its top-level model set to `name` (the same bytes when it already is)."""
        value = json.dumps(name).encode()
        if self.span is not None:
            if self.model == name:
                return body
            start, end = self.span
            return body[:start] + value + body[end:]
        member = b'"model":' + value + (b"" if self.empty else b",")
        return body[: self.brace + 1] + member + body[self.brace + 1 :]


def scan(body: Body, ascii: bool | None = None) -> Found | None:
    """The top-level ``model`` of a JSON object, found without decoding the document; None
    when the scan cannot decide (then parse the body with `json.loads`). `ascii`: whether the
    body is known to be ASCII (else it is checked here)."""
    s = Scan(body)
    s.feed(len(body))
    return s.result(ascii)


class Scan:
    """`scan`, done piece by piece while the body arrives into `buf` (of `total` bytes): each
    `feed` walks what has come so far, so little is left to walk once the last piece is in.
    A token that ends where the data so far ends is read again once more has come (``12`` may
    be the start of ``123``), and so is one with `_SETTLED` bytes or fewer after it (``1.``
    may be the start of ``1.5``)."""

    __slots__ = ("_buf", "_done", "_found", "_gen", "_total")

    def __init__(self, buf: Body, total: int | None = None) -> None:
        self._buf = buf
        self._total = len(buf) if total is None else total
        self._gen = _scanner(buf, self._total)
        self._done = False
        self._found: Found | None = None
        next(self._gen)  # runs to its first wait for data

    def feed(self, avail: int) -> None:
        """The first `avail` bytes of the buffer are in."""
        if self._done:
            return
        try:
            self._gen.send(avail)
        except StopIteration as stop:
            self._done, self._found = True, stop.value
        except (_Undecided, ValueError):  # ValueError: a bad string (JSONDecodeError), UTF-8
            self._done = True

    def result(self, ascii: bool | None = None) -> Found | None:
        """What the scan found once the whole body is in (`feed` of its length); None: not
        decided. `ascii`: whether the body is known to be ASCII (else it is checked here)."""
        if not self._done:
            self.feed(self._total)
        if self._found is None:
            return None
        b = self._buf
        if not (b.isascii() if ascii is None else ascii):
            try:
                b.decode("utf-8")  # json.loads then gives its own error
            except UnicodeDecodeError:
                return None
        return self._found


def _string_end(b: Body, i: int, avail: int) -> int:
    """For a string whose contents started before `i` (with no closing quote before `i`):
    the index after its closing quote (the first quote after an even run of backslashes),
    or -1 when it is not in ``b[:avail]``."""
    j = b.find(b'"', i, avail)
    while j >= 0:
        k = j - 1
        while b[k] == _BACKSLASH:
            k -= 1
        if (j - 1 - k) % 2 == 0:
            return j + 1
        j = b.find(b'"', j + 1, avail)
    return -1


def _decode(b: Body, start: int, end: int) -> str:
    """The string token at b[start:end] (quotes included), decoded and checked by json."""
    value, _ = _scanstring(b[start:end].decode("utf-8"), 1, True)
    return str(value)


def _scanner(b: Body, total: int) -> Generator[None, int, Found]:
    """The scan as a generator: sent how many bytes of `b` are in, it walks them and waits
    for more (yields) until the object has closed and all `total` bytes have come; raises
    `_Undecided` (or ValueError) when it cannot decide."""
    avail = yield
    pos = 0
    while True:  # the opening brace
        m = _TOKEN.match(b, pos, avail)
        if (m is not None and m.end() + _SETTLED < avail) or avail >= total:
            break
        avail = yield
    if m is None or m.lastindex != 1 or b[m.end() - 1] != _LBRACE:
        raise _Undecided
    pos = m.end()
    brace = pos - 1
    stack = [_LBRACE]
    state = _KEY_OR_END
    model: str | None = None
    span: tuple[int, int] | None = None
    empty = True
    is_model = False  # the value being read belongs to the top-level key "model"
    is_stream = False  # ... to the top-level key "stream"
    stream = False
    for _ in range(MIN_TOKENS + total // BYTES_PER_TOKEN):
        while True:
            m = _TOKEN.match(b, pos, avail)
            if (m is not None and m.end() + _SETTLED < avail) or avail >= total:
                break
            avail = yield
        if m is None:
            raise _Undecided
        pos = m.end()
        kind = m.lastindex
        c = b[pos - 1] if kind == 1 else 0
        if kind == 2:  # a string: find where it ends
            start = pos - 1
            end = _string_end(b, pos, avail)
            while end < 0:
                if avail >= total:
                    raise _Undecided
                searched, avail = avail, (yield)
                end = _string_end(b, searched, avail)
            pos = end
        if state == _COMMA_OR_END:
            top = stack[-1]
            if c == _COMMA:
                state = _KEY if top == _LBRACE else _VALUE
            elif (c == _RBRACE and top == _LBRACE) or (c == _RBRACK and top == _LBRACK):
                stack.pop()
                if not stack:
                    break
            else:
                raise _Undecided
        elif state == _VALUE or state == _VALUE_OR_END:
            if kind == 2:
                if is_model:
                    model, span = _decode(b, start, pos), (start, pos)
                elif pos - start < CHECK_STRINGS_BELOW:
                    _decode(b, start, pos)
                state = _COMMA_OR_END
            elif kind == 3:
                if is_model:
                    raise _Undecided  # a model that is not a string: json.loads says so
                if is_stream:
                    stream = m.group(3) == b"true"
                state = _COMMA_OR_END
            elif c == _LBRACE or c == _LBRACK:
                if is_model or len(stack) >= MAX_DEPTH:
                    raise _Undecided
                stack.append(c)
                state = _KEY_OR_END if c == _LBRACE else _VALUE_OR_END
            elif c == _RBRACK and state == _VALUE_OR_END:
                stack.pop()
                state = _COMMA_OR_END
            else:
                raise _Undecided
            if is_stream and kind != 3:
                stream = False  # the last "stream" wins, and only a literal true streams
            is_model = is_stream = False
        elif state == _KEY or state == _KEY_OR_END:
            if kind == 2:
                if pos - start < CHECK_STRINGS_BELOW:
                    key = _decode(b, start, pos)  # checked at every depth
                    top = len(stack) == 1
                    is_model, is_stream = top and key == "model", top and key == "stream"
                else:
                    is_model = is_stream = False  # a long key: only its bounds are checked
                if len(stack) == 1:
                    empty = False
                state = _COLON_NEXT
            elif c == _RBRACE and state == _KEY_OR_END:
                stack.pop()
                if not stack:
                    break
                state = _COMMA_OR_END
            else:
                raise _Undecided
        elif c == _COLON:  # state == _COLON_NEXT
            state = _VALUE
        else:
            raise _Undecided
    else:
        raise _Undecided  # too many tokens for the body's size
    while avail < total:  # the object has closed: only whitespace may follow
        if _END.match(b, pos, avail) is None:
            raise _Undecided
        pos, avail = avail, (yield)
    if _END.match(b, pos) is None:
        raise _Undecided
    return Found(model, span, brace, empty, stream)


class Parsed:
    """A request body's model and how to give the engine the body for a canonical name."""

    __slots__ = ("_data", "_found", "body", "model")

    def __init__(
        self, body: Body, model: str, data: dict[str, Any] | None, found: Found | None
    ) -> None:
        self.body = body
        self.model = model
        self._data = data
        self._found = found

    @property
    def stream(self) -> bool:
        """The request asks for a stream (a top-level ``"stream": true``)."""
        if self._found is not None:
            return self._found.stream
        return self._data is not None and self._data.get("stream") is True

    def body_for(self, name: str) -> Body:
        """The bytes to send when the model's canonical name is `name`: the body as received
        unless it names the model otherwise (an alias, or a model given in the path)."""
        if self._found is not None:
            return self._found.with_model(self.body, name)
        data = self._data
        assert data is not None
        if data.get("model") == name:
            return self.body
        data["model"] = name  # an alias: the engine only knows the canonical name
        return json.dumps(data).encode()


def model_of(
    body: Body, forced: str | None = None, ascii: bool | None = None, scanned: Scan | None = None
) -> Parsed:
    """The body's ``model`` (or `forced`); `BadRequest` for anything unusable. `ascii`: whether
    the body is known to be ASCII, and `scanned`: its scan, fed while it arrived (the reader
    does both piece by piece, while the pieces are hot)."""
    if not body:
        raise BadRequest("the request body is empty; expected a JSON object")
    if scanned is not None:
        found = scanned.result(ascii)
    else:
        found = scan(body, ascii) if len(body) >= SCAN_MIN_BYTES else None
    data: dict[str, Any] | None = None
    if found is not None:
        model: Any = forced or found.model
    else:
        data = _parse(body)
        model = forced or data.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("'model' is required and must be a non-empty string", param="model")
    return Parsed(body, model, data, found)


def _parse(body: Body) -> dict[str, Any]:
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as err:
        raise BadRequest(f"the request body is not valid JSON: {err}") from None
    except RecursionError:
        raise BadRequest("the request body is nested too deeply") from None
    if not isinstance(data, dict):
        raise BadRequest("the request body must be a JSON object")
    return data
