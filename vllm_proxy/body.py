"""Request bodies: find the ``model`` a JSON request names, and give the engine its bytes.

A small body is parsed whole with `json.loads`, as it always was. A large one (a chat request
with base64 images, a long document) is scanned instead: `scan` walks the top-level object
token by token, jumping over string contents with `bytes.find` rather than decoding them, and
reads only the ``model`` value. Parsing a 10 MB request with one base64 image took 12 ms of the
proxy's time per request; the scan takes 0.4 ms. The bytes are forwarded as received;
for an alias only the model value is replaced, in place.

A large body whose length is known is kept as the pieces it arrived in (`Pieces`), never
copied into one buffer, and scanned piece by piece as they come (`Scan.feed`): what the scan
walks is copied into a small window, except the inside of a long string (the image), which is
searched for its closing quote where it lies. When the last piece is in, the model is known
and the pieces go on to the engine as they are, in one `writelines`.

The scan checks what it walks as strictly as the parser: the grammar of every token at every
depth, numbers and literals (``NaN`` and ``Infinity`` included, as `json.loads` takes them),
every string's bounds, the contents of every string under 64 KiB (escapes, control
characters, UTF-8), UTF-8 between strings, the nesting depth, and nothing after the object.
The contents of a longer string (the base64 image itself) are not looked at: a bad escape, a
raw control character or bad UTF-8 in one reaches the engine, which rejects the body itself.
Whenever the scan cannot decide (not an object, anything invalid, a non-string ``model``, too
many tokens for its size, too deep), the body is parsed with `json.loads`, whose answer (and
error message) is the one the client gets. Duplicate keys behave as in `json.loads`: the last
``model`` wins, and that is the one replaced for an alias.
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


class Pieces:
    """A large body as the pieces it arrived in; they go to the engine as they are."""

    __slots__ = ("parts", "size")

    def __init__(self, parts: list[bytes]) -> None:
        self.parts = parts
        self.size = sum(map(len, parts))

    def __len__(self) -> int:
        return self.size

    def __bytes__(self) -> bytes:
        return b"".join(self.parts)

    def replace(self, start: int, end: int, value: bytes) -> Pieces:
        """These pieces with bytes ``[start, end)`` replaced by `value` (only the pieces that
        hold the boundaries are cut; the others are shared)."""
        out: list[bytes] = []
        at = 0
        placed = False
        for part in self.parts:
            a, b = at, at + len(part)
            at = b
            if b <= start or a >= end:  # wholly outside the replaced range
                if a >= end and not placed:
                    out.append(value)
                    placed = True
                out.append(part)
                continue
            if a < start:
                out.append(part[: start - a])
            if not placed:
                out.append(value)
                placed = True
            if b > end:
                out.append(part[end - a :])
        if not placed:
            out.append(value)
        return Pieces([p for p in out if p])


#: A request body: bytes, or a large one as the pieces it arrived in.
Body = bytes | bytearray | Pieces


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
#: While waiting for more of the body, whitespace already in is passed for good (so a body
#: padded with megabytes of it is walked once, not once per piece), and a token still open
#: after this many bytes (a number of a thousand digits) is left to `json.loads`.
_SPACE = re.compile(rb"[ \t\n\r]*")
_PENDING_MAX = 1024

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
        else:
            value = b'"model":' + value + (b"" if self.empty else b",")
            start = end = self.brace + 1
        if isinstance(body, Pieces):
            return body.replace(start, end, value)
        return body[:start] + value + body[end:]


def scan(body: bytes | bytearray) -> Found | None:
    """The top-level ``model`` of a JSON object, found without decoding the document; None
    when the scan cannot decide (then parse the body with `json.loads`)."""
    return Scan(len(body), body).result()


#: What the scan asks of `Scan.feed` when it waits: more of the body (None), or, inside a long
#: string, the body from that string's closing quote on (`_SKIP`).
_SKIP = 1


class Scan:
    """`scan`, done piece by piece while a body of `total` bytes arrives: each `feed` walks
    what has come so far, so little is left to walk once the last piece is in.

    What the scan walks is copied into a window; the inside of a long string is not (once a
    string is `CHECK_STRINGS_BELOW` long, `feed` finds its closing quote in the pieces
    themselves, counting the backslashes before each quote across pieces), so the window holds
    the document's structure and at most a piece of each long string. Positions found in the
    window are mapped back to the body's (`_holes`). A token that ends where the data so far
    ends is read again once more has come (``12`` may be the start of ``123``), and so is one
    with `_SETTLED` bytes or fewer after it (``1.`` may be the start of ``1.5``)."""

    __slots__ = ("_answered", "_carry", "_done", "_found", "_gen", "_got", "_holes", "_longs",
                 "_skipping", "_total", "_win")  # fmt: skip

    def __init__(self, total: int, whole: bytes | bytearray | None = None) -> None:
        """`whole`: the whole body at once (scanned where it lies, not copied)."""
        self._total = total
        self._win: bytes | bytearray = bytearray() if whole is None else whole
        #: (window index, bytes of the body left out before it), one per skipped long string.
        self._holes: list[tuple[int, int]] = []
        #: Window spans of long strings' contents, not checked for UTF-8.
        self._longs: list[tuple[int, int]] = []
        self._skipping = False
        self._carry = 0  # backslashes that ended the skipped part so far
        self._got = 0
        self._done = False
        self._answered = False
        self._found: Found | None = None
        self._gen = _scanner(self._win, total, self._longs)
        next(self._gen)  # runs to its first wait for data
        if whole is not None:
            self._got = len(whole)
            self._send(True)

    def feed(self, piece: bytes) -> None:
        """The next piece of the body."""
        self._got += len(piece)
        if self._done:
            return
        final = self._got >= self._total
        if self._skipping:
            q = self._close(piece)
            if q < 0:
                if final:  # the string never closes
                    self._done = True
                return
            skipped = self._got - len(piece) + q - self._abs(len(self._win))
            self._holes.append((len(self._win), skipped))
            self._skipping = False
            piece = piece[q:] if q else piece
        self._win += piece  # a bytearray while pieces come (bytes only when whole)
        self._send(final)

    def _send(self, final: bool) -> None:
        try:
            asked = self._gen.send((len(self._win), final))
        except StopIteration as stop:
            self._done, self._found = True, stop.value
            return
        except (_Undecided, ValueError):  # ValueError: a bad string (JSONDecodeError), UTF-8
            self._done = True
            return
        if asked == _SKIP:  # inside a long string: what follows is searched, not copied
            self._skipping = True
            win = self._win
            k = len(win) - 1
            while win[k] == _BACKSLASH:
                k -= 1
            self._carry = len(win) - 1 - k

    def _close(self, piece: bytes) -> int:
        """Where the skipped string's closing quote is in `piece` (-1: not in it)."""
        j = piece.find(b'"')
        while j >= 0:
            k = j - 1
            while k >= 0 and piece[k] == _BACKSLASH:
                k -= 1
            run = j - 1 - k + (self._carry if k < 0 else 0)
            if run % 2 == 0:
                return j
            j = piece.find(b'"', j + 1)
        k = len(piece) - 1
        while k >= 0 and piece[k] == _BACKSLASH:
            k -= 1
        self._carry = len(piece) - 1 - k + (self._carry if k < 0 else 0)
        return -1

    def _abs(self, i: int) -> int:
        """The body's index of window index `i`."""
        return i + sum(skipped for at, skipped in self._holes if at <= i)

    def result(self) -> Found | None:
        """What the scan found once the whole body is in; None: not decided. Once called, the
        scan keeps only its answer (its window is let go)."""
        if self._answered:
            return self._found
        self._answered = self._done = True
        self._gen.close()
        win, self._win = self._win, b""
        found, self._found = self._found, None
        if found is None:
            return None
        at = 0
        for a, b in [*self._longs, (len(win), len(win))]:  # UTF-8 outside long strings
            part = win[at:a]
            if not part.isascii():
                try:
                    part.decode("utf-8")  # json.loads then gives its own error
                except UnicodeDecodeError:
                    return None
            at = b
        if self._holes:
            found.brace = self._abs(found.brace)
            if found.span is not None:
                found.span = (self._abs(found.span[0]), self._abs(found.span[1] - 1) + 1)
        self._found = found
        return found


def _string_end(b: bytes | bytearray, i: int, avail: int) -> int:
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


def _decode(b: bytes | bytearray, start: int, end: int) -> str:
    """The string token at b[start:end] (quotes included), decoded and checked by json."""
    value, _ = _scanstring(b[start:end].decode("utf-8"), 1, True)
    return str(value)


def _scanner(
    b: bytes | bytearray, total: int, longs: list[tuple[int, int]]
) -> Generator[int | None, tuple[int, bool], Found]:
    """The scan as a generator over the window `b`: sent how much of it is in and whether
    that is all, it walks it and waits for more (yields None) until the object has closed and
    the body has ended; inside a long string it yields `_SKIP`, and is then sent the window
    with the string's closing quote where the window had ended. Notes the spans of long
    strings' contents in `longs`. Raises `_Undecided` (or ValueError) when it cannot decide."""
    avail, final = yield None
    pos = 0
    while True:  # the opening brace
        pos = _SPACE.match(b, pos, avail).end()  # type: ignore[union-attr]  # always matches
        m = _TOKEN.match(b, pos, avail)
        if (m is not None and m.end() + _SETTLED < avail) or final:
            break
        if avail - pos > _PENDING_MAX:
            raise _Undecided
        avail, final = yield None
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
            pos = _SPACE.match(b, pos, avail).end()  # type: ignore[union-attr]  # always matches
            m = _TOKEN.match(b, pos, avail)
            if (m is not None and m.end() + _SETTLED < avail) or final:
                break
            if avail - pos > _PENDING_MAX:  # a number this long: json.loads reads it
                raise _Undecided
            avail, final = yield None
        if m is None:
            raise _Undecided
        pos = m.end()
        kind = m.lastindex
        c = b[pos - 1] if kind == 1 else 0
        if kind == 2:  # a string: find where it ends
            start = pos - 1
            end = _string_end(b, pos, avail)
            while end < 0:
                if final:
                    raise _Undecided
                searched = avail
                if avail - start >= CHECK_STRINGS_BELOW and not is_model:
                    avail, final = yield _SKIP  # its closing quote is now at `searched`
                    end = searched + 1
                    break
                avail, final = yield None
                end = _string_end(b, searched, avail)
            pos = end
            if pos - start >= CHECK_STRINGS_BELOW:
                longs.append((start + 1, pos - 1))
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
    while not final:  # the object has closed: only whitespace may follow
        if _END.match(b, pos, avail) is None:
            raise _Undecided
        pos = avail
        avail, final = yield None
    if _END.match(b, pos, avail) is None:
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


def model_of(body: Body, forced: str | None = None, scanned: Scan | None = None) -> Parsed:
    """The body's ``model`` (or `forced`); `BadRequest` for anything unusable. `scanned`: the
    body's scan, fed piece by piece while it arrived."""
    if not body:
        raise BadRequest("the request body is empty; expected a JSON object")
    if scanned is not None:
        found = scanned.result()
    elif len(body) >= SCAN_MIN_BYTES:
        found = scan(bytes(body) if isinstance(body, Pieces) else body)
    else:
        found = None
    data: dict[str, Any] | None = None
    if found is not None:
        model: Any = forced or found.model
    else:
        data = _parse(bytes(body) if isinstance(body, Pieces) else body)
        model = forced or data.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("'model' is required and must be a non-empty string", param="model")
    return Parsed(body, model, data, found)


def _parse(body: bytes | bytearray) -> dict[str, Any]:
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as err:
        raise BadRequest(f"the request body is not valid JSON: {err}") from None
    except RecursionError:
        raise BadRequest("the request body is nested too deeply") from None
    if not isinstance(data, dict):
        raise BadRequest("the request body must be a JSON object")
    return data
