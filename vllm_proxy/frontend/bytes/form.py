"""``multipart/form-data`` bodies: the ``model`` field of an upload, found as the body goes by.

vLLM's speech-to-text routes (``/v1/audio/transcriptions``, ``/v1/audio/translations``) take a
form: the audio file and the request's fields, ``model`` among them. The proxy needs only that
field, and must not hold the audio: `FormScan` is fed the body piece by piece as it arrives and
keeps nothing of it but the part head it is reading (bounded) and the ``model`` value (bounded).
The file's bytes are only searched for the next boundary (``bytes.find``), never copied. It
notes where the value lies in the body, so that an alias can be replaced by the canonical name
(`Rename`), and checks the framing to the closing boundary, so that a truncated body is a 400.

The grammar is RFC 7578 / RFC 2046 as Starlette (vLLM's server) reads it: an optional preamble,
``--boundary`` (after a CRLF unless it opens the body), transport padding, CRLF, the part's
headers, an empty line, its content; the closing ``--boundary--``; an epilogue, ignored.
"""

from __future__ import annotations

import re

from ...errors import BadRequest

#: A part's head (its header lines) may be at most this long.
MAX_HEAD_BYTES = 16 * 1024
#: The ``model`` value may be at most this long.
MAX_MODEL_BYTES = 1024
#: At most this many parts (Starlette refuses more than 1000 fields or files).
MAX_PARTS = 1000
#: The form field that names the model.
MODEL = "model"
#: The media type of a form upload.
FORM_DATA = "multipart/form-data"

MISSING = "'model' is required and must be a non-empty string (a form field)"
TRUNCATED = "the multipart body ends before its closing boundary (truncated?)"

_CONTENT, _HEAD = 0, 1
#: ``; name=value`` or ``; name="quoted value"`` in a Content-Disposition header.
_PARAM = re.compile(rb';\s*([!#$%&\'*+.^_`|~0-9A-Za-z-]+)\s*=\s*("(?:[^"\\]|\\.)*"|[^;\s]*)')
_ESCAPE = re.compile(rb"\\(.)")
#: What RFC 2046 allows in a boundary (1-70 characters, no space at the end).
_BOUNDARY = re.compile(r"[0-9A-Za-z'()+_,\-./:=? ]{0,69}[0-9A-Za-z'()+_,\-./:=?]")


def boundary_of(content_type: str) -> bytes:
    """The boundary named by a ``multipart/form-data`` Content-Type; `BadRequest` when it names
    none, or one RFC 2046 does not allow, or more than one (vLLM's parser takes the last, a
    reader that takes the first would see another form)."""
    found = [
        _unquote(m.group(2)).decode("latin-1")
        for m in _PARAM.finditer(content_type.encode("latin-1", "replace"))
        if m.group(1).lower() == b"boundary"
    ]
    if len(found) == 1 and _BOUNDARY.fullmatch(found[0]):
        return found[0].encode("latin-1")
    raise BadRequest(
        f"the Content-Type {FORM_DATA} has no valid boundary parameter: {content_type[:200]!r}"
    )


def _unquote(value: bytes) -> bytes:
    if value.startswith(b'"') and value.endswith(b'"') and len(value) >= 2:
        return _ESCAPE.sub(rb"\1", value[1:-1])
    return value


class FormScan:
    """Walks a form body fed in pieces (`feed`), and says at its end (`end`) whether it was
    whole. `model` is set as soon as the ``model`` field's content has ended; `span` is where
    its value lies in the body, and `first` where the first part begins (its ``--boundary``),
    where a ``model`` field can be put for a body that has none. Raises `BadRequest` for a
    body it cannot take: a head over `MAX_HEAD_BYTES`, more than `MAX_PARTS` parts, ``model``
    given twice, as a file, empty, not UTF-8 or over `MAX_MODEL_BYTES`."""

    __slots__ = ("_delim", "_head", "_in_model", "_state", "_tail", "_value", "_value_at",
                 "closed", "first", "model", "parts", "received", "span")  # fmt: skip

    def __init__(self, boundary: bytes) -> None:
        self._delim = b"\r\n--" + boundary
        self._state = _CONTENT  # the preamble is read as the content of no part
        # The bytes before the next piece in which a delimiter may begin: a CRLF before the
        # body, so that a body that opens with ``--boundary`` is found like any other.
        self._tail = b"\r\n"
        self._head = bytearray()
        self._in_model = False
        self._value = bytearray()
        self._value_at = 0
        #: Bytes fed so far.
        self.received = 0
        self.parts = 0
        self.closed = False
        self.model: str | None = None
        self.span: tuple[int, int] | None = None
        self.first: int | None = None

    def feed(self, data: bytes) -> None:
        pos, size = 0, len(data)
        while pos < size and not self.closed:  # (after the closing boundary: the epilogue)
            pos = self._content(data, pos) if self._state == _CONTENT else self._part(data, pos)
        self.received += size

    def end(self) -> None:
        """The body has ended: `BadRequest` unless its closing boundary was seen."""
        if not self.closed:
            if self.first is None:
                raise BadRequest("the body has no part delimited by its Content-Type's boundary")
            raise BadRequest(TRUNCATED)

    def _content(self, data: bytes, pos: int) -> int:
        """Search the content for the next delimiter; returns where the scan goes on in `data`."""
        delim, base = self._delim, self.received
        keep = len(delim) - 1
        found: int | None = None  # the delimiter's offset in the body (-2: it opens the body)
        tail = self._tail
        if tail:  # one that begins in the bytes before this piece
            i = (tail + data[pos : pos + keep]).find(delim)
            if i >= 0:
                found = base + pos - len(tail) + i
        if found is None:
            i = data.find(delim, pos)
            if i >= 0:
                found = base + i
        if found is None:
            if self._in_model:
                self._take_value(data[pos:])
            if len(data) - pos >= keep:
                self._tail = data[len(data) - keep :]
            else:
                self._tail = (tail + data[pos:])[-keep:]
            return len(data)
        if self._in_model:
            self._take_value(data[pos : max(pos, found - base)])
            self._end_model(found)
        if self.first is None:
            self.first = found + 2  # (after the CRLF: the ``--boundary`` itself)
        self._state = _HEAD
        self._head.clear()
        self._tail = b""
        return found - base + len(delim)

    def _take_value(self, piece: bytes) -> None:
        self._value += piece
        if len(self._value) > MAX_MODEL_BYTES + len(self._delim):
            raise BadRequest(f"'{MODEL}' is longer than {MAX_MODEL_BYTES} bytes", param=MODEL)

    def _end_model(self, end: int) -> None:
        self._in_model = False
        raw = bytes(self._value[: end - self._value_at])
        self._value.clear()
        if not raw:
            raise BadRequest(MISSING, param=MODEL)
        if len(raw) > MAX_MODEL_BYTES:
            raise BadRequest(f"'{MODEL}' is longer than {MAX_MODEL_BYTES} bytes", param=MODEL)
        try:
            self.model = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise BadRequest(f"'{MODEL}' is not UTF-8 text", param=MODEL) from None
        self.span = (self._value_at, end)

    def _part(self, data: bytes, pos: int) -> int:
        """Read the rest of a delimiter line and the part's head; returns where its content
        begins in `data` (or the end of `data`, when more must come)."""
        head = self._head
        before = len(head)
        head += data[pos : pos + MAX_HEAD_BYTES + 4 - before]
        if head[:2] == b"--":
            self.closed = True
            return len(data)
        if len(head) < 2:
            return len(data)
        eol = head.find(b"\r\n")
        if eol >= 0 and head[:eol].strip(b" \t"):
            raise BadRequest("malformed multipart body: text after a boundary")
        end = head.find(b"\r\n\r\n", eol) if eol >= 0 else -1
        if end < 0:
            if len(head) > MAX_HEAD_BYTES:
                raise BadRequest(f"a part's headers are longer than {MAX_HEAD_BYTES} bytes")
            return len(data)
        self._begin(bytes(head[eol + 2 : end]))
        at = pos + end + 4 - before  # where the content begins in `data`
        self._state = _CONTENT
        if self._in_model:
            self._value_at = self.received + at
        return at

    def _begin(self, head: bytes) -> None:
        """A part begins: is it the ``model`` field?"""
        self.parts += 1
        if self.parts > MAX_PARTS:
            raise BadRequest(f"the form has more than {MAX_PARTS} parts")
        name: bytes | None = None
        is_file = False
        for line in head.split(b"\r\n") if head else ():
            key, colon, value = line.partition(b":")
            if not colon:
                raise BadRequest("malformed multipart body: a part header without a colon")
            if key.strip().lower() != b"content-disposition":
                continue
            for match in _PARAM.finditer(value):
                param = match.group(1).lower()
                if param == b"name":
                    name = _unquote(match.group(2))
                elif param in (b"filename", b"filename*"):
                    is_file = True
        if name != MODEL.encode():
            return
        if is_file:
            raise BadRequest(f"'{MODEL}' must be a form field, not a file", param=MODEL)
        if self.model is not None or self._in_model:
            raise BadRequest(f"the form gives '{MODEL}' more than once", param=MODEL)
        self._in_model = True
        self._value.clear()


class Rename:
    """Bytes put in place of a range of a body as it is passed on: the canonical name in place
    of the ``model`` value (an alias), or a whole ``model`` field inserted (an empty range)."""

    __slots__ = ("end", "start", "value")

    def __init__(self, start: int, end: int, value: bytes) -> None:
        self.start, self.end, self.value = start, end, value

    @property
    def growth(self) -> int:
        """How much longer the body becomes."""
        return len(self.value) - (self.end - self.start)

    def apply(self, piece: bytes, at: int) -> list[bytes]:
        """`piece`, which lies at offset `at` of the body, as it goes on."""
        stop = at + len(piece)
        start, end = self.start, self.end
        holds_start = at <= start < stop  # the value goes in this piece
        if not holds_start and (stop <= start or at >= end):
            return [piece]
        out = []
        if holds_start:
            out += [piece[: start - at], self.value]
        if stop > end:
            out.append(piece[max(end - at, 0) :])
        return [p for p in out if p]


def model_field(boundary: bytes, name: str) -> bytes:
    """A ``model`` form field (with the delimiter that opens it), to put before a form's first
    part."""
    disposition = f'Content-Disposition: form-data; name="{MODEL}"'.encode()
    return b"--%b\r\n%b\r\n\r\n%b\r\n" % (boundary, disposition, name.encode())
