"""Request bodies: find the ``model`` a JSON request names, and give the engine its bytes.

A small body is parsed whole with `json.loads`, as it always was. A large one (a chat request
with base64 images, a long history, a long document), or a mid-sized one dense with objects and
arrays (`needs_scan`), is scanned instead, and never parsed: `json.loads` builds the whole
document in Python objects, many times its size for dense JSON (``[{},{},...]``), and holds the
only event loop meanwhile, while the scan reads two values and skips the rest (the figures:
docs/benchmarks.md, "Measurements behind the design"). The bytes are forwarded as received; for
an alias only the model value is replaced, in place.

`Scan` walks the top-level object token by token, jumps over long strings with `bytes.find`
rather than decoding them, and reads only the ``model`` and ``stream`` values. Runs of
complete values inside it (the messages, an array of token ids, a tool's schema) are checked
by one compiled regex each (`_bulk_value`): one C call instead of a Python step per token.
What the regexes cannot take (a string with a word over 256 bytes, such as base64, a value
nested more than `BULK_DEPTH` levels, what is still arriving) is opened token by token, and
the runs go on inside it.

A large body is kept as the pieces it arrived in (`Pieces`), never copied into one buffer,
and scanned piece by piece as they come (`Scan.feed`): what the scan walks is copied into a
window, except the inside of a long string (the image), which is searched for its closing
quote where it lies, and the window lets go of what the scan has walked, so a dense body is
not held twice. When the last piece is in, the model is known and the pieces go on to the
engine as they are, in one `writelines`.

The scan checks what it walks as strictly as the parser: the grammar of every token at every
depth, numbers and literals (``NaN`` and ``Infinity`` included, as `json.loads` takes them),
every string's bounds, the contents of every string under 64 KiB (escapes, control
characters, UTF-8), UTF-8 between strings, the nesting depth, and nothing after the object.
The contents of a longer string (the base64 image itself) are not looked at: a bad escape, a
raw control character or bad UTF-8 in one reaches the engine, which rejects the body itself.
Duplicate keys behave as in `json.loads`: the last ``model`` wins, and that is the one
replaced for an alias. What the scan refuses, it answers with its own 400, naming what is
wrong and where; that includes valid JSON no client sends: nesting deeper than `MAX_DEPTH`
levels, a number with more than 1024 digits in a part, and more structure read token by token
than one token per `BYTES_PER_TOKEN` bytes of body (past `MIN_TOKENS`).
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Generator
from typing import Any

from ...errors import BadRequest

#: Bodies from this size on are scanned rather than parsed whole.
SCAN_MIN_BYTES = 256 * 1024
#: From this size on, a body with more than one ``{`` or ``[`` per `DENSE_BYTES` is scanned
#: too. Below it `json.loads` takes at most about 2 ms and 2.6 MB whatever the body; dense
#: JSON builds 25 to 40 times its size in objects (at 256 KiB: 15 ms and 10 MB), while a
#: sparser one of 256 KiB (numbers, strings) takes at most 5 ms and 13 times its size.
DENSE_FROM = 64 * 1024
DENSE_BYTES = 32
#: Strings shorter than this are checked whole (escapes, control characters) by json's own
#: string scanner; longer ones only for their bounds.
CHECK_STRINGS_BELOW = 64 * 1024
#: The scan reads at most `MIN_TOKENS` tokens one at a time, and one more per this many bytes
#: of body so far (tokens in bulk runs are not counted): past that it refuses the body (about
#: 1 µs of the event loop per token).
BYTES_PER_TOKEN = 32
MIN_TOKENS = 2048
#: Deeper nesting is refused.
MAX_DEPTH = 256
#: The bulk regex checks values up to this many levels of nesting in one call; a deeper value
#: is opened token by token until what is inside fits. Each level doubles the regex (five:
#: 19 KiB, compiled in about 30 ms at import); five covers a tool definition with its schema.
BULK_DEPTH = 5


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


def needs_scan(body: Body) -> bool:
    """Whether `model_of` scans this body rather than parsing it (two byte counts at most,
    about 1 ns a byte, on a body of `DENSE_FROM` to `SCAN_MIN_BYTES`)."""
    size = len(body)
    if size >= SCAN_MIN_BYTES:
        return True
    if size < DENSE_FROM or isinstance(body, Pieces):
        return False
    return (body.count(b"{") + body.count(b"[")) * DENSE_BYTES > size


_TOKEN = re.compile(
    rb"[ \t\n\r]*(?:"
    rb"([{}\[\],:])"  # 1: structure
    rb'|(")'  # 2: a string opens
    rb"|(-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?|true|false|null|NaN|-?Infinity)"
    rb")"
)
_END = re.compile(rb"[ \t\n\r]*\Z")
_scanstring: Any = json.decoder.scanstring  # type: ignore[attr-defined]


_WS = rb"[ \t\n\r]*+"
#: A string, as the bulk regexes take it: words of at most 256 ASCII bytes between spaces,
#: non-ASCII bytes and escapes, so that text of any length is taken, but base64 (an image)
#: fails the match after 256 bytes, and the token scan skips it with `bytes.find`.
_WORD = rb'[^"\\\x00-\x1f\x80-\xff ]{0,256}+'
_ESCAPE = rb'\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4})'
_STRING = rb'"' + _WORD + rb"(?:(?:[ \x80-\xff]++|" + _ESCAPE + rb")" + _WORD + rb')*+"'


def _bulk_value(depth: int) -> bytes:
    """A regex for one JSON value nested at most `depth` levels, checked as strictly as the
    token scan checks short strings (UTF-8 aside, checked over the window as the scan goes).
    No atomic groups: the alternatives differ in their first byte and every repeat is
    possessive, so a failure costs one try per level, and plain groups match about twice as
    fast (and scalars tried first, twice as fast again on arrays of numbers)."""
    scalar = (
        _STRING
        + rb"|-?+(?:0|[1-9][0-9]{0,1023}+)(?:\.[0-9]{1,1024}+)?+(?:[eE][+-]?+[0-9]{1,1024}+)?+"
        + rb"|true|false|null|NaN|-?Infinity"
    )
    value = rb"(?:" + scalar + rb"|\[" + _WS + rb"\]|\{" + _WS + rb"\})"
    for _ in range(depth):
        # Items separated by commas, the item pattern written once: after each item either a
        # comma not followed by the closing bracket, or the closing bracket itself.
        array = rb"\[" + _WS + rb"(?:" + value + _WS + rb"(?:," + _WS + rb"(?!\])|(?=\])))*+\]"
        member = _STRING + _WS + rb":" + _WS + value + _WS
        obj = rb"\{" + _WS + rb"(?:" + member + rb"(?:," + _WS + rb"(?!\})|(?=\})))*+\}"
        value = rb"(?:" + scalar + rb"|" + array + rb"|" + obj + rb")"
    return value


def _run(item: bytes, close: bytes) -> re.Pattern[bytes]:
    """Items of a container, each followed by its comma or by the closing bracket (not
    taken: the match ends with a comma unless the container ends after its last item)."""
    return re.compile(rb"(?:" + _WS + item + _WS + rb"(?:,|(?=" + close + rb")))*+")


@functools.cache
def bulk() -> tuple[re.Pattern[bytes], re.Pattern[bytes]]:
    """The bulk regexes: runs of array elements, and of object members. Compiling them takes
    about 0.2 s (the regex module parses them in Python), once per process: the proxy does it
    as it starts, so the first body does not wait for it."""
    value = _bulk_value(BULK_DEPTH)
    return _run(value, rb"\]"), _run(_STRING + _WS + rb":" + _WS + value, rb"\}")


#: How far ahead one bulk match may look.
_REACH = 64 * 1024

#: A token is read as final only with more than this many bytes after it in: ``1.`` and
#: ``1e+`` read as the number ``1`` until the digit after them has come.
_SETTLED = 2
#: A number with more digits than this in its integer part, its fraction or its exponent is
#: refused (by the token scan and the bulk regexes alike, wherever the pieces end).
_DIGITS_MAX = 1024
_NUMBER_PARTS = re.compile(rb"[0-9]+")
#: While waiting for more of the body, whitespace already in is passed for good (so a body
#: padded with megabytes of it is walked once, not once per piece), and a token still open
#: after this many bytes (a number too long) is refused.
_SPACE = re.compile(rb"[ \t\n\r]*")
_PENDING_MAX = 3 * _DIGITS_MAX + 8

_LBRACE, _RBRACE, _LBRACK, _RBRACK, _COMMA, _COLON = b"{}[],:"
_BACKSLASH, _QUOTE = 0x5C, 0x22
# What the scan expects next.
_VALUE, _VALUE_OR_END, _KEY, _KEY_OR_END, _COLON_NEXT, _COMMA_OR_END = range(6)

_INVALID = "the request body is not valid JSON"
_LONG_NUMBER = f"the request body has a number of over {_DIGITS_MAX} digits"
_NOT_OBJECT = "the request body must be a JSON object"
_TOO_DENSE = (
    "the request body has more structure than the proxy reads for its size (over one JSON "
    f"token per {BYTES_PER_TOKEN} bytes outside the runs of values it checks in bulk)"
)


class _Refused(Exception):
    """The scan refuses the body: the client's message, and where (a window index)."""

    def __init__(self, message: str, at: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.at = at


class Found:
    """What `scan` found: the top-level ``model`` (its last occurrence; None with a span: it
    is not a string), where its value is, where the object opens, whether its top-level
    ``stream`` is ``true``, and its top-level integer ``priority`` (vLLM's field), if any."""

    __slots__ = ("brace", "empty", "model", "priority", "span", "stream")

    def __init__(
        self,
        model: str | None,
        span: tuple[int, int] | None,
        brace: int,
        empty: bool,
        stream: bool = False,
        priority: int | None = None,
    ) -> None:
        self.model = model
        self.span = span
        self.brace = brace
        self.empty = empty
        self.stream = stream
        self.priority = priority

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
    """The top-level ``model`` of a JSON object, found without decoding the document, all at
    once; None when the body is refused (`Scan.error` says why)."""
    s = Scan(len(body), body)
    s.walk(len(body))
    return s.result()


#: The window lets go of what the scan has walked once it is this long.
CUT_FROM = 64 * 1024
#: What the scan yields when it waits: how far it has walked (>= 0), or, inside a long string,
#: `_SKIP`: then it is sent the body from that string's closing quote on.
_SKIP = -1


class Scan:
    """`scan`, done piece by piece while a body arrives: each `feed` walks what has come so
    far, so little is left to walk once the last piece is in. `error` is set as soon as the
    body is refused, so a reader can stop there.

    What the scan walks is copied into a window; the inside of a long string is not (once a
    string is `CHECK_STRINGS_BELOW` long, `feed` finds its closing quote in the pieces
    themselves, counting the backslashes before each quote across pieces), so the window holds
    the document's structure and at most a piece of each long string. Positions found in the
    window are mapped back to the body's (`_holes`). A token that ends where the data so far
    ends is read again once more has come (``12`` may be the start of ``123``), and so is one
    with `_SETTLED` bytes or fewer after it (``1.`` may be the start of ``1.5``). What has
    been walked is checked for UTF-8 as the scan goes (long strings' contents aside)."""

    __slots__ = ("_answered", "_base", "_carry", "_checked", "_cut", "_done", "_error",
                 "_found", "_gen", "_got", "_holes", "_longs", "_nlongs", "_skipping", "_total",
                 "_whole", "_win")  # fmt: skip

    def __init__(self, total: int | None = None, whole: bytes | bytearray | None = None) -> None:
        """`total`: the body's length, when it is known (else `end` says where it ends).
        `whole`: the whole body at once, walked where it lies (not copied) by `walk`."""
        self._whole = whole is not None
        self._total = len(whole) if whole is not None else total
        self._win: bytes | bytearray = bytearray() if whole is None else whole
        #: Positions kept (holes, long strings, what is found) count the window's bytes from
        #: its start, what was cut from it (`_base`) included.
        self._base = 0
        self._cut = 0  # ... cut since the generator was last sent the window
        #: (window position, bytes of the body left out before it), one per skipped long
        #: string.
        self._holes: list[tuple[int, int]] = []
        #: Window spans of long strings' contents, not checked for UTF-8.
        self._longs: list[tuple[int, int]] = []
        self._nlongs = 0  # ... of which the UTF-8 check has passed this many
        self._checked = 0  # the window is valid UTF-8 up to here
        self._skipping = False
        self._carry = 0  # backslashes that ended the skipped part so far
        self._got = 0
        self._done = False
        self._answered = False
        self._found: Found | None = None
        #: Why the body is refused (kept as text: an exception kept here and raised would hold,
        #: through its traceback, the frames that hold this scan and the whole body).
        self._error: str | None = None
        self._gen = _scanner(self._win, self._longs, whole is None)
        next(self._gen)  # runs to its first wait for data

    @property
    def error(self) -> BadRequest | None:
        """Why the body is refused, once it is (the client's 400): a new exception each time."""
        return BadRequest(self._error) if self._error is not None else None

    @property
    def skipping(self) -> bool:
        """The scan is inside a long string: `skip` passes over it without copying."""
        return self._skipping and not self._done

    def feed(self, piece: bytes, start: int = 0, stop: int | None = None) -> None:
        """The next piece of the body: ``piece[start:stop]``."""
        stop = len(piece) if stop is None else min(stop, len(piece))
        if self._skipping:
            start = self.skip(piece, start, stop)
        if self._done or stop <= start:
            return
        self._got += stop - start
        if start == 0 and stop == len(piece):
            self._win += piece  # a bytearray while pieces come (bytes only when whole)
        else:
            self._win += memoryview(piece)[start:stop]
        self._send(len(self._win), self._total is not None and self._got >= self._total)

    def skip(self, piece: bytes, start: int, stop: int) -> int:
        """Inside a long string: pass over ``piece[start:stop]`` up to the string's closing
        quote; returns where the scan goes on (`stop` when the quote is not there)."""
        q = self._close(piece, start, stop)
        if q < 0:
            self._got += stop - start
            if self._total is not None and self._got >= self._total:  # it never closes
                self._refuse(_Refused(f"{_INVALID}: a string does not end"))
            return stop
        self._got += q - start
        end = self._base + len(self._win)
        self._holes.append((end, self._got - self._abs(end)))
        self._skipping = False
        return q

    def walk(self, upto: int) -> None:
        """A scan of a whole body: walk it up to byte `upto` (the last call: its length)."""
        upto = min(upto, len(self._win))
        if self._done or upto <= self._got:
            return
        self._got = upto
        self._send(upto, upto == len(self._win))

    def end(self) -> None:
        """The body has ended (where its length was not known)."""
        if self._done:
            return
        if self._skipping:
            self._refuse(_Refused(f"{_INVALID}: a string does not end"))
            return
        if self._whole:
            self._got = len(self._win)
        self._send(len(self._win), True)

    def _send(self, avail: int, final: bool) -> None:
        cut, self._cut = self._cut, 0
        try:
            asked = self._gen.send((avail, final, self._got, cut))
        except StopIteration as stop:
            self._done = True
            if self._utf8(len(self._win)):
                self._found = stop.value
            return
        except _Refused as refused:
            self._refuse(refused)
            return
        if asked != _SKIP:
            if self._utf8(asked) and asked >= CUT_FROM and not self._whole:
                # What the scan has walked and checked is let go: the window holds what is
                # still to walk (a dense body is not copied whole).
                del self._win[:asked]  # type: ignore[union-attr]  # a bytearray unless whole
                self._base += asked
                self._cut = asked
            return
        self._skipping = True  # inside a long string: what follows is searched, not copied
        win = self._win
        k = len(win) - 1
        while win[k] == _BACKSLASH:
            k -= 1
        self._carry = len(win) - 1 - k

    def _utf8(self, upto: int) -> bool:
        """Check the window for UTF-8 up to `upto` (where the scan has walked: no character is
        cut there), long strings' contents aside; False (refused) for bad UTF-8."""
        win, longs, base = self._win, self._longs, self._base
        at = self._checked - base
        spans = [(a - base, b - base) for a, b in longs[self._nlongs :]]
        self._nlongs = len(longs)
        for a, b in [*spans, (upto, upto)]:
            if a > at:
                part = win[at:a]
                if not part.isascii():
                    try:
                        part.decode("utf-8")
                    except UnicodeDecodeError as err:
                        self._refuse(_Refused(f"{_INVALID}: bad UTF-8", at + err.start))
                        return False
            at = max(at, b)
        self._checked = base + at
        return True

    def _refuse(self, refused: _Refused) -> None:
        self._done = True
        where = "" if refused.at is None else f" (at byte {self._abs(self._base + refused.at)})"
        self._error = refused.message + where

    def _close(self, piece: bytes, start: int, stop: int) -> int:
        """Where the skipped string's closing quote is in ``piece[start:stop]`` (-1: not in
        it)."""
        j = piece.find(b'"', start, stop)
        while j >= 0:
            k = j - 1
            while k >= start and piece[k] == _BACKSLASH:
                k -= 1
            run = j - 1 - k + (self._carry if k < start else 0)
            if run % 2 == 0:
                return j
            j = piece.find(b'"', j + 1, stop)
        k = stop - 1
        while k >= start and piece[k] == _BACKSLASH:
            k -= 1
        self._carry = stop - 1 - k + (self._carry if k < start else 0)
        return -1

    def _abs(self, i: int) -> int:
        """The body's index of window position `i`."""
        return i + sum(skipped for at, skipped in self._holes if at <= i)

    def result(self) -> Found | None:
        """What the scan found once the whole body is in (the body ends here if it has not
        yet); None: refused, and `error` says why. Once called, the scan keeps only its
        answer (its window is let go)."""
        if self._answered:
            return self._found
        if not self._done:
            self.end()
        self._answered = True
        self._gen.close()
        self._win = b""
        found = self._found
        if found is not None and self._holes:
            found.brace = self._abs(found.brace)
            if found.span is not None:
                found.span = (self._abs(found.span[0]), self._abs(found.span[1] - 1) + 1)
        return found


#: Request priorities the queue takes (vLLM's field is an int; anything else is the engine's
#: to refuse, and ranks as 0 here).
PRIORITY_RANGE = 2**31


def _integer(token: bytes | bytearray) -> int | None:
    """A JSON integer literal in `PRIORITY_RANGE`, else None."""
    try:
        value = int(token)
    except ValueError:
        return None
    return value if -PRIORITY_RANGE < value < PRIORITY_RANGE else None


def priority_of(data: dict[str, Any]) -> int | None:
    """The parsed body's integer ``priority`` (booleans are not integers here), else None."""
    value = data.get("priority")
    if isinstance(value, int) and not isinstance(value, bool):
        return value if -PRIORITY_RANGE < value < PRIORITY_RANGE else None
    return None


def _too_long(number: bytes) -> bool:
    return any(len(part) > _DIGITS_MAX for part in _NUMBER_PARTS.findall(number))


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
    try:
        value, _ = _scanstring(b[start:end].decode("utf-8"), 1, True)
    except ValueError:  # a bad escape or control character (JSONDecodeError), bad UTF-8
        raise _Refused(f"{_INVALID}: a bad string", start) from None
    return str(value)


def _scanner(
    b: bytes | bytearray, longs: list[tuple[int, int]], skips: bool
) -> Generator[int, tuple[int, bool, int, int], Found]:
    """The scan as a generator over the window `b`: sent how much of it is in, whether that is
    all, how much of the body has come and how many bytes the window has lost from its start
    since (what the scan had walked), it walks it and waits for more (yields how far it has
    walked) until the object has closed and the body has ended; inside a long string it yields
    `_SKIP` (where `skips`), and is then sent the window with the string's closing quote where
    the window had ended. Notes the spans of long strings' contents in `longs`. Raises
    `_Refused` (at a window index) for a body it refuses.

    Inside the top-level object's values, runs of complete items are checked by the `bulk`
    regexes (one C call each); the tokens they do not take (the top level, long strings, what
    is nested deeper than `BULK_DEPTH`, what is still arriving) are read one at a time."""
    avail, final, got, cut = yield 0
    base = 0  # window bytes the scan has let go of (`Scan.feed` cuts what it has walked)
    pos = 0
    while True:  # the opening brace
        pos = _SPACE.match(b, pos, avail).end()  # type: ignore[union-attr]  # always matches
        m = _TOKEN.match(b, pos, avail)
        if (m is not None and m.end() + _SETTLED < avail) or final:
            break
        if avail - pos > _PENDING_MAX:
            break
        avail, final, got, cut = yield pos
        pos, base = pos - cut, base + cut
    if m is None:
        raise _Refused(_INVALID, pos)
    if m.lastindex != 1 or b[m.end() - 1] != _LBRACE:
        if m.lastindex != 1 or b[m.end() - 1] == _LBRACK:  # a string, number, array
            raise _Refused(_NOT_OBJECT)
        raise _Refused(_INVALID, pos)
    pos = m.end()
    brace = base + pos - 1  # positions kept are the window's as if it were never cut
    stack = [_LBRACE]
    state = _KEY_OR_END
    elements, members = bulk()
    model: str | None = None
    span: tuple[int, int] | None = None
    model_level = 0  # a model that is a container (not valid): its level while it is open
    model_start = 0
    empty = True
    is_model = False  # the value being read belongs to the top-level key "model"
    is_stream = False  # ... to the top-level key "stream"
    stream = False
    is_priority = False  # ... to the top-level key "priority"
    priority: int | None = None
    tokens = 0
    while True:
        depth = len(stack)
        if 1 < depth < MAX_DEPTH - BULK_DEPTH and (
            state == _KEY
            or state == _KEY_OR_END
            or (stack[-1] == _LBRACK and (state == _VALUE or state == _VALUE_OR_END))
        ):
            # Members or elements in bulk, as far as they are complete, each followed by its
            # comma or by the container's end (the top level's few members, ``model`` and
            # ``stream`` among them, are read token by token). What a run cannot take (a
            # value too large, too deep or still arriving) is read token by token, and the
            # runs go on inside it. A run looks at most `_REACH` ahead, and is tried again at
            # once only when that, not an item it could not take, stopped it.
            reach = min(avail, pos + _REACH)
            run = elements if stack[-1] == _LBRACK else members
            end = run.match(b, pos, reach).end()  # type: ignore[union-attr]  # always matches
            if end > pos:
                pos = end
                if b[end - 1] == _COMMA:  # more items follow
                    state = _VALUE if stack[-1] == _LBRACK else _KEY
                else:
                    state = _COMMA_OR_END  # the closing bracket is next
                if reach < avail and reach - end < _REACH // 2:
                    continue
        while True:
            pos = _SPACE.match(b, pos, avail).end()  # type: ignore[union-attr]  # always matches
            m = _TOKEN.match(b, pos, avail)
            if (m is not None and m.end() + _SETTLED < avail) or final:
                break
            if avail - pos > _PENDING_MAX:
                if m is None:
                    raise _Refused(_INVALID, pos)
                raise _Refused(_LONG_NUMBER, pos)
            avail, final, got, cut = yield pos
            pos, base = pos - cut, base + cut
        if m is None:
            raise _Refused(_INVALID if pos < avail else f"{_INVALID}: it ends too soon", pos)
        tokens += 1
        if tokens > MIN_TOKENS + got // BYTES_PER_TOKEN:
            raise _Refused(_TOO_DENSE, pos)
        pos = m.end()
        kind = m.lastindex or 0
        c = b[pos - 1] if kind == 1 else 0
        if kind == 2:  # a string: find where it ends
            start = pos - 1
            end = _string_end(b, pos, avail)
            while end < 0:
                if final:
                    raise _Refused(f"{_INVALID}: a string does not end", start)
                searched = avail
                if skips and avail - start >= CHECK_STRINGS_BELOW and not is_model:
                    avail, final, got, cut = yield _SKIP  # its closing quote is now at `searched`
                    start, end, base = start - cut, searched - cut + 1, base + cut
                    break
                avail, final, got, cut = yield start
                start, searched, base = start - cut, searched - cut, base + cut
                end = _string_end(b, searched, avail)
            pos = end
            if pos - start >= CHECK_STRINGS_BELOW:
                longs.append((base + start + 1, base + pos - 1))
        if c == _RBRACE or c == _RBRACK:
            opener = _LBRACE if c == _RBRACE else _LBRACK
            if stack[-1] != opener or not (
                state == _COMMA_OR_END
                or (state == _KEY_OR_END and c == _RBRACE)
                or (state == _VALUE_OR_END and c == _RBRACK)
            ):
                raise _Refused(_INVALID, pos - 1)
            stack.pop()
            if len(stack) < model_level:  # the (invalid) container model has closed
                span, model_level = (model_start, base + pos), 0
            if not stack:
                break
            state = _COMMA_OR_END
        elif state == _COMMA_OR_END:
            if c != _COMMA:
                raise _Refused(_INVALID, m.start(kind))
            state = _KEY if stack[-1] == _LBRACE else _VALUE
        elif state == _VALUE or state == _VALUE_OR_END:
            if kind == 2:
                if is_model:
                    model, span = _decode(b, start, pos), (base + start, base + pos)
                elif pos - start < CHECK_STRINGS_BELOW:
                    _decode(b, start, pos)
            elif kind == 3:
                if pos - m.start(3) > _DIGITS_MAX and _too_long(m.group(3)):
                    raise _Refused(_LONG_NUMBER, m.start(3))
                if is_model:  # not a string: refused, unless the path names the model
                    model, span = None, (base + m.start(3), base + pos)
                if is_stream:
                    stream = m.group(3) == b"true"
                if is_priority:
                    priority = _integer(m.group(3))
            elif c == _LBRACE or c == _LBRACK:
                if len(stack) >= MAX_DEPTH:
                    raise _Refused(
                        f"the request body is nested too deeply (over {MAX_DEPTH} levels)", pos
                    )
                stack.append(c)
                if is_model:
                    model, span, model_level, model_start = None, None, len(stack), base + pos - 1
                state = _KEY_OR_END if c == _LBRACE else _VALUE_OR_END
            else:
                raise _Refused(_INVALID, pos - 1)
            if c != _LBRACE and c != _LBRACK:
                state = _COMMA_OR_END
            if is_stream and kind != 3:
                stream = False  # the last "stream" wins, and only a literal true streams
            if is_priority and kind != 3:
                priority = None
            is_model = is_stream = is_priority = False
        elif state == _KEY or state == _KEY_OR_END:
            if kind != 2:
                raise _Refused(_INVALID, m.start(kind))
            if pos - start < CHECK_STRINGS_BELOW:
                key = _decode(b, start, pos)  # checked at every depth
                top = len(stack) == 1
                is_model, is_stream = top and key == "model", top and key == "stream"
                is_priority = top and key == "priority"
            else:  # a long key: only its bounds are checked
                is_model = is_stream = is_priority = False
            if len(stack) == 1:
                empty = False
            state = _COLON_NEXT
        elif c == _COLON:  # state == _COLON_NEXT
            state = _VALUE
        else:
            raise _Refused(_INVALID, m.start(kind))
    while not final:  # the object has closed: only whitespace may follow
        if _END.match(b, pos, avail) is None:
            raise _Refused(f"{_INVALID}: more follows the object", pos)
        pos = avail
        avail, final, got, cut = yield pos
        pos, base = pos - cut, base + cut
    if _END.match(b, pos, avail) is None:
        raise _Refused(f"{_INVALID}: more follows the object", pos)
    return Found(model, span, brace, empty, stream, priority)


class Parsed:
    """A request body's model, whether it asks for a stream, and how to give the engine the
    body for a canonical name. A parsed document is kept only until `body_for`: a request
    holds its bytes, not the objects they make."""

    __slots__ = ("_data", "_found", "body", "model", "priority", "stream")

    def __init__(
        self,
        body: Body,
        model: str,
        data: dict[str, Any] | None,
        found: Found | None,
        stream: bool = False,
        priority: int | None = None,
    ) -> None:
        self.body = body
        self.model = model
        self._data = data
        self._found = found
        #: The request asks for a stream (a top-level ``"stream": true``).
        self.stream = stream
        #: Its top-level integer ``priority`` (vLLM's; lower is served first), if any.
        self.priority = priority

    def body_for(self, name: str) -> Body:
        """The bytes to send when the model's canonical name is `name`: the body as received
        unless it names the model otherwise (an alias, or a model given in the path)."""
        if self._found is not None:
            return self._found.with_model(self.body, name)
        data, self._data = self._data, None
        if data is None:  # asked twice: parsed again (a small body)
            data = _parse(bytes(self.body) if isinstance(self.body, Pieces) else self.body)
        if data.get("model") == name:
            return self.body
        data["model"] = name  # an alias: the engine only knows the canonical name
        return json.dumps(data).encode()


def model_of(body: Body, forced: str | None = None, scanned: Scan | None = None) -> Parsed:
    """The body's ``model`` (or `forced`); `BadRequest` for anything unusable. `scanned`: the
    body's scan, fed while it arrived; without one, a body that `needs_scan` is scanned here,
    at once."""
    if not body:
        raise BadRequest("the request body is empty; expected a JSON object")
    if scanned is None and needs_scan(body):
        scanned = Scan(len(body), bytes(body) if isinstance(body, Pieces) else body)
        scanned.walk(len(body))
    if scanned is not None:
        found = scanned.result()
        if found is None:
            raise scanned.error or BadRequest(_INVALID)
        model: Any = forced or found.model
        _check_model(model)
        return Parsed(body, model, None, found, found.stream, found.priority)
    data = _parse(bytes(body) if isinstance(body, Pieces) else body)
    model = forced or data.get("model")
    _check_model(model)
    return Parsed(body, model, data, None, data.get("stream") is True, priority_of(data))


def _check_model(model: Any) -> None:
    if not isinstance(model, str) or not model:
        raise BadRequest("'model' is required and must be a non-empty string", param="model")


def _parse(body: bytes | bytearray) -> dict[str, Any]:
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as err:
        raise BadRequest(f"{_INVALID}: {err}") from None
    except RecursionError:
        raise BadRequest("the request body is nested too deeply") from None
    if not isinstance(data, dict):
        raise BadRequest(_NOT_OBJECT)
    return data
