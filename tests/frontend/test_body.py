"""Finding ``model`` in a request body without parsing it whole (`vllm_proxy.frontend.bytes.body`).

Every case is checked against `json.loads`: the scan must find what the parser finds, and
refuse what the parser refuses (then the client gets the scan's 400).
"""

from __future__ import annotations

import json
import random
import sys
import tracemalloc
from typing import Any

import pytest
from kit import heap_probe

from vllm_proxy.errors import BadRequest
from vllm_proxy.frontend.bytes import body as body_mod
from vllm_proxy.frontend.bytes.body import (
    BULK_DEPTH,
    CHECK_STRINGS_BELOW,
    MAX_DEPTH,
    SCAN_MIN_BYTES,
    Found,
    Pieces,
    Scan,
    model_of,
    scan,
)


def parsed_model(doc: bytes) -> Any:
    return json.loads(doc).get("model")


@pytest.mark.parametrize(
    "doc",
    [
        b'{"model":"a"}',
        b' \t\r\n{ "model" : "a" }\n ',
        b'{"messages":[{"role":"user","content":"hi"}],"model":"m"}',
        b'{"model":"first","x":1,"model":"last"}',  # duplicates: the last wins, as in json.loads
        b'{"x":{"model":"nested"},"model":"top"}',  # a nested "model" is not the model
        b'{"x":[{"model":"in an array"}],"y":{"z":{"model":"deep"}}}',  # none at the top
        b'{"x":"\\"model\\": \\"inside a string\\"","model":"y"}',
        b'{"x":"ends with a backslash \\\\","model":"y"}',
        b'{"x":"\\\\\\"","model":"y"}',  # an escaped backslash, then an escaped quote
        b'{"mod\\u0065l":"escaped key"}',
        b'{"model":"\\u00e9t\\u00e9 \\ud83d\\ude00"}',  # escapes in the value
        b'{"model":"caf\xc3\xa9"}',  # UTF-8 in the value
        b'{"model":"x\\/y\\n"}',
        b"{}",
        b'{"a":[1,-2.5e+3,0,true,false,null,NaN,Infinity,-Infinity],"b":{},"c":[]}',
        b'{"a":[[[[]]]],"model":"after depth"}',
        b'{"":"empty key","model":""}',
    ],
)
def test_scan_agrees_with_the_parser(doc: bytes) -> None:
    found = scan(doc)
    assert found is not None, "the scan decides on valid JSON"
    assert found.model == parsed_model(doc)


@pytest.mark.parametrize(
    "doc",
    [
        b"[1, 2]",  # not an object
        b'"model"',
        b"",
        b"   ",
        b"{not json",
        b'{"a":1,}',
        b'{"a" 1}',
        b'{"a":1 "b":2}',
        b'{"a":[1 2]}',
        b'{"a":[1,]}',
        b'{"a":01}',
        b'{"a":1.}',
        b'{"a":tru}',
        b'{"a":[}',
        b'{"a":{]}',
        b'{"a":"unterminated}',
        b'{"model":"x"} trailing',
        b'{"model":"x"}{}',
        b'{"model":"x"',
        b'{"a":"\x01"}',  # a raw control character in a (short) string
        b'{"a":"\\x"}',  # a bad escape
        b'{"a":"\\u12"}',
        b'{"a":"\xff"}',  # not UTF-8
        b'\xef\xbb\xbf{"model":"bom"}',  # a BOM (json.loads refuses it too)
        b'{"a" : 1 , }',
        b"{,}",
        b'{"a":1}}',
    ],
)
def test_scan_refuses_what_the_parser_refuses(doc: bytes) -> None:
    s = Scan(len(doc), doc)
    s.walk(len(doc))
    assert s.result() is None
    assert s.error is not None and s.error.status == 400


@pytest.mark.parametrize("doc", [b'{"model":5}', b'{"model":{"a":[1]}}', b'{"model":null}'])
def test_a_model_that_is_not_a_string_is_found_and_refused(doc: bytes) -> None:
    """The scan finds where it is (so a model given in the path replaces it, as the parser's
    dict would), and `model_of` refuses it otherwise."""
    found = scan(doc)
    assert found is not None and found.model is None and found.span is not None
    for body in (doc, large(doc)):
        with pytest.raises(BadRequest, match="'model' is required"):
            model_of(body)
        parsed = model_of(body, forced="p")
        assert json.loads(bytes(parsed.body_for("p"))) == {"model": "p"}


def test_deep_nesting_is_refused() -> None:
    ok = b'{"x":' + b"[" * (MAX_DEPTH - 2) + b"]" * (MAX_DEPTH - 2) + b',"model":"m"}'
    assert scan(ok + b" " * 100_000) is not None
    deep = b'{"x":' + b"[" * MAX_DEPTH + b"]" * MAX_DEPTH + b',"model":"m"}'
    assert scan(deep + b" " * 100_000) is None
    with pytest.raises(BadRequest, match="nested too deeply"):
        model_of(deep + b" " * SCAN_MIN_BYTES)


def test_a_dense_body_is_scanned_in_bulk_not_parsed(monkeypatch: pytest.MonkeyPatch) -> None:
    """An array of numbers (token ids), arrays of objects: the bulk regexes take them, nothing
    is parsed, and the model and stream come out as the parser reads them."""
    monkeypatch.setattr(body_mod, "_parse", lambda b: pytest.fail("parsed"))
    for doc in (
        {"model": "m", "prompt": list(range(200_000))},
        {"input": [[{}, [], {"a": [1, 2.5e-3, None, True]}]] * 20_000, "model": "m"},
        {
            "messages": [{"role": "user", "content": "x\n" * 50}] * 5000,
            "stream": True,
            "model": "m",
        },
    ):
        raw = json.dumps(doc).encode()
        parsed = model_of(raw)
        assert (parsed.model, parsed.stream) == ("m", doc.get("stream") is True)


def test_long_strings_are_only_bounded() -> None:
    """A string of 64 KiB or more is skipped by its bounds: escaped quotes inside still count as
    inside, and its contents are not decoded."""
    long = "a" * CHECK_STRINGS_BELOW
    doc = json.dumps({"x": long + '"model": "no"' + long, "model": "yes"}).encode()
    assert scan(doc) is not None and scan(doc).model == "yes"  # type: ignore[union-attr]
    ctrl = b'{"x":"' + b"a" * CHECK_STRINGS_BELOW + b'\x01","model":"m"}'
    found = scan(ctrl)  # a raw control character in a long string is the engine's to refuse
    assert found is not None and found.model == "m"
    long_key = b'{"' + b"k" * CHECK_STRINGS_BELOW + b'":1,"model":"m"}'
    assert scan(long_key).model == "m"  # type: ignore[union-attr]


def random_value(rng: random.Random, depth: int) -> Any:
    kind = rng.randrange(8 if depth < 4 else 5)
    if kind == 0:
        return rng.randint(-(10**6), 10**6)
    if kind == 1:
        return rng.random() * 10 ** rng.randint(-5, 5)
    if kind == 2:
        return rng.choice([True, False, None])
    if kind in (3, 4):
        alphabet = 'ab "\\/\n\t\u00e9\u2028\U0001f600model{}[],:'
        return "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 12)))
    if kind in (5, 6):
        keys = ["model", "messages", "content", "x", 'mo"del', "mod\\el"]
        return {rng.choice(keys): random_value(rng, depth + 1) for _ in range(rng.randint(0, 4))}
    return [random_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]


def test_random_documents_agree_with_the_parser() -> None:
    rng = random.Random(20260101)
    decided = 0
    for _ in range(3000):
        doc: dict[str, Any] = {}
        for _ in range(rng.randint(0, 5)):
            key = rng.choice(["model", "messages", "x", "stream", "model"])
            doc[key] = random_value(rng, 1)
        if rng.random() < 0.7:
            doc["model"] = random_value(rng, 4) if rng.random() < 0.2 else "m-" + str(rng.random())
        text = json.dumps(doc, ensure_ascii=rng.random() < 0.5, indent=rng.choice([None, 1]))
        raw = text.encode()
        found = scan(raw)
        want = doc.get("model")
        assert found is not None, raw
        assert found.model == (want if isinstance(want, str) else None), raw
        assert (found.span is not None) == ("model" in doc), raw
        decided += isinstance(want, str)
    assert decided > 1000


@pytest.mark.parametrize(
    ("doc", "name", "expected"),
    [
        (b'{"model":"alias","x":1}', "canonical", {"model": "canonical", "x": 1}),
        (b'{"model":"a","model":"alias"}', "canonical", {"model": "canonical"}),
        (b'{"x":1}', "forced", {"x": 1, "model": "forced"}),
        (b"{ }", "forced", {"model": "forced"}),
        (b'{"model":"same"}', "same", {"model": "same"}),
    ],
)
def test_the_engine_gets_the_body_with_the_canonical_name(
    doc: bytes, name: str, expected: dict[str, Any]
) -> None:
    found = scan(doc)
    assert found is not None
    out = found.with_model(doc, name)
    assert json.loads(out) == expected
    if found.model == name:
        assert out is doc, "a body that already names the model goes on as received"


def test_only_the_model_value_changes_for_an_alias() -> None:
    doc = b'{"messages" : [ {"content": "\\u00e9"} ],\n "model":"alias" }'
    found = scan(doc)
    assert found is not None
    assert found.with_model(doc, "real") == doc.replace(b'"alias"', b'"real"')


def large(doc: bytes) -> bytes:
    """`doc` padded with whitespace to the size from which bodies are scanned."""
    return doc + b" " * SCAN_MIN_BYTES


@pytest.mark.parametrize(
    ("doc", "fragment"),
    [
        (b"{not json", "not valid JSON"),
        (b"[1, 2]", "must be a JSON object"),
        (b'{"messages": []}', "'model' is required"),
        (b'{"model": 5}', "'model' is required"),
        (b'{"model": ""}', "'model' is required"),
        (b'{"model": "x", "a": [1 2]}', "not valid JSON"),
        (b'{"x": ' + b"[" * 5000 + b"]" * 5000 + b', "model": "m"}', "nested too deeply"),
    ],
)
def test_large_bad_bodies_get_the_same_errors_as_small_ones(doc: bytes, fragment: str) -> None:
    for body in (doc, large(doc)):
        with pytest.raises(BadRequest, match=fragment):
            model_of(body)


def test_large_bodies_are_scanned_and_small_ones_parsed(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = body_mod._parse
    monkeypatch.setattr(body_mod, "_parse", lambda b: calls.append(len(b)) or real(b))
    small = b'{"model": "m"}'
    assert model_of(small).model == "m" and calls == [len(small)]
    calls.clear()
    assert model_of(large(small)).model == "m" and calls == []
    assert model_of(bytearray(large(small))).model == "m", "the reader's buffer scans too"
    assert calls == []
    parsed = model_of(large(b'{"x": 1}'), forced="from-path")
    assert parsed.model == "from-path"
    assert json.loads(parsed.body_for("from-path")) == {"x": 1, "model": "from-path"}


@pytest.mark.parametrize(
    "doc",
    [
        b'{"model":"m","stream":true}',
        b'{"stream":true,"model":"m"}',
        b'{"model":"m","stream":false}',
        b'{"model":"m"}',
        b'{"model":"m","stream":"true"}',  # a string is not a stream request
        b'{"model":"m","stream":1}',
        b'{"model":"m","stream":{"x":true}}',
        b'{"model":"m","x":{"stream":true}}',  # a nested "stream" is not the request's
        b'{"model":"m","stream":true,"stream":false}',  # the last one wins
        b'{"model":"m","stream":false,"stream":true}',
        b'{"model":"m","stream":null}',
    ],
)
def test_stream_is_read_like_the_parser_reads_it(doc: bytes) -> None:
    """`Parsed.stream` (does a model that is still loading owe this client keep-alives?) is the
    same for a small body, parsed, and for a large one, scanned."""
    expected = json.loads(doc).get("stream") is True
    assert model_of(doc).stream is expected
    padding = b'"pad":"' + b"x" * SCAN_MIN_BYTES + b'",'
    large = doc[:1] + padding + doc[1:]
    found = scan(large)
    assert found is not None, "a large body is scanned"
    assert found.stream is expected
    assert model_of(large).stream is expected


def scan_in_pieces(doc: bytes, cuts: list[int]) -> Found | None:
    """`doc` scanned as a reader scans it: piece by piece as they arrive."""
    s = Scan(len(doc))
    for a, b in zip([0, *cuts], [*cuts, len(doc)], strict=True):
        s.feed(doc[a:b])
    return s.result()


def same(a: Found | None, b: Found | None) -> bool:
    if a is None or b is None:
        return a is b
    return (a.model, a.span, a.brace, a.empty, a.stream) == (
        b.model,
        b.span,
        b.brace,
        b.empty,
        b.stream,
    )


@pytest.mark.parametrize(
    "doc",
    [
        b'{"n": 12345, "model": "m"}',  # a number cut after "12": not the number 12
        b'{"t": true, "f": false, "z": null, "model": "m", "stream": true}',  # literals cut
        b'{"x": "a\\\\\\"b\\"", "model": "m"}',  # runs of backslashes cut anywhere
        b'{"model": "m"}   \n\t ',  # whitespace after the object, in pieces
        b'{"model": "m"}   x',  # something after the object, arriving last: not decided
        b'{"model": "m"',  # the object never closes
        b'{"model": "m", "x": "no end',  # a string never closes
        b'  {"a": [1, [2, {"b": "c"}]], "model": "caf\xc3\xa9"}',  # UTF-8 cut mid-character
        b'{"model": "\\u00e9", "stream": false}',
        b"[1, 2]",
        b"",
    ],
)
def test_a_body_scanned_as_it_arrives_gives_what_a_whole_scan_gives(doc: bytes) -> None:
    whole = scan(doc)
    for cut in range(1, len(doc)):  # every two-piece split
        assert same(scan_in_pieces(doc, [cut]), whole), (doc, cut)
    assert same(scan_in_pieces(doc, list(range(1, len(doc)))), whole), "a byte at a time"


def test_random_documents_scanned_in_random_pieces_agree() -> None:
    rng = random.Random(20261123)
    decided = 0
    for _ in range(800):
        doc: dict[str, Any] = {}
        for _ in range(rng.randint(0, 5)):
            doc[rng.choice(["model", "messages", "x", "stream"])] = random_value(rng, 1)
        if rng.random() < 0.7:
            doc["model"] = "m-" + str(rng.random())
        raw = json.dumps(doc, ensure_ascii=rng.random() < 0.5, indent=rng.choice([None, 1]))
        raw_b = raw.encode() + b" " * rng.randint(0, 3)
        cuts = sorted(rng.sample(range(1, len(raw_b)), min(len(raw_b) - 1, rng.randint(1, 12))))
        whole = scan(raw_b)
        assert same(scan_in_pieces(raw_b, cuts), whole), (raw_b, cuts)
        decided += whole is not None
    assert decided > 400


def test_a_scan_fed_while_the_body_arrives_is_the_one_model_of_uses() -> None:
    doc = large(b'{"messages": [], "model": "m", "stream": true}')
    s = Scan(len(doc))
    s.feed(doc)
    parsed = model_of(Pieces([doc]), None, s)
    assert parsed.model == "m" and parsed.stream
    # A scan that refuses the body says why, and where.
    bad = large(b'{"model": "m", "x": [1 2]}')
    s = Scan(len(bad))
    s.feed(bad)
    with pytest.raises(BadRequest, match=r"not valid JSON \(at byte 23\)"):
        model_of(Pieces([bad]), None, s)


def long_doc(rng: random.Random) -> bytes:
    """A request with long strings (skipped by a scan in pieces), some ending in backslash
    runs or holding escaped quotes, a few short members around them, the model anywhere."""
    members: list[bytes] = []
    for _ in range(rng.randint(1, 3)):
        inner = rng.choice([b"QUJD", b"\\\\", b'\\"', b'ab\\\\\\"c']) * rng.randint(1, 4)
        text = b"x" * rng.randint(CHECK_STRINGS_BELOW, CHECK_STRINGS_BELOW + 5000) + inner
        members.append(b'"%s": "%s"' % (rng.choice([b"image", b"model", b"data"]), text))
    members.append(b'"n": [1, 2.5e+3, true, null, {"model": "nested"}]')
    members.append(b'"model": "m-%d"' % rng.randint(0, 99))
    members.append(b'"stream": %s' % rng.choice([b"true", b"false"]))
    rng.shuffle(members)
    return b"{" + b", ".join(members) + b"}" + b" " * rng.randint(0, 2)


def test_long_strings_scanned_in_pieces_agree_with_the_parser() -> None:
    rng = random.Random(11)
    for _ in range(60):
        doc = long_doc(rng)
        whole = scan(doc)
        want = json.loads(doc)
        assert whole is not None and whole.model == want["model"]
        assert whole.stream == (want["stream"] is True)
        cuts = sorted(rng.sample(range(1, len(doc)), rng.randint(1, 40)))
        quotes = [i for i in range(len(doc)) if doc[i] == 0x22]  # and cuts at quotes
        cuts = sorted(set(cuts + [q for q in rng.sample(quotes, 3) if q > 0]))
        assert same(scan_in_pieces(doc, cuts), whole), cuts


def test_an_alias_in_pieces_is_replaced_where_it_lies() -> None:
    image = b"QUJD" * (CHECK_STRINGS_BELOW // 2)
    doc = b'{"messages": "%s", "model": "alias", "max_tokens": 1}' % image
    at = doc.index(b'"alias"')
    for cuts in ([at + 2], [at, at + 7], [100, 70_000, len(doc) - 3], [at - 1, at + 1]):
        s = Scan(len(doc))
        parts = [doc[a:b] for a, b in zip([0, *cuts], [*cuts, len(doc)], strict=True)]
        for p in parts:
            s.feed(p)
        found = s.result()
        assert found is not None and found.model == "alias"
        out = found.with_model(Pieces(parts), "canonical")
        assert isinstance(out, Pieces)
        assert bytes(out) == doc.replace(b'"alias"', b'"canonical"')
        start, end = at, at + len(b'"alias"')
        offsets = [0, *cuts]
        away = [p for p, a in zip(parts, offsets, strict=True) if a + len(p) <= start or a >= end]
        assert all(any(q is p for q in out.parts) for p in away), "passed on as they are"
    bare = doc.replace(b'"model": "alias", ', b"")  # a model given in the path instead
    forced = Scan(len(bare))
    forced.feed(bare[:9])
    forced.feed(bare[9:])
    found = forced.result()
    assert found is not None and found.model is None
    out = found.with_model(Pieces([bare[:9], bare[9:]]), "p")
    assert json.loads(bytes(out)) == {**json.loads(bare), "model": "p"}


def test_bad_utf8_is_refused_but_not_inside_a_long_string() -> None:
    long = b"QUJD" * (CHECK_STRINGS_BELOW // 2)
    bad_short = b'{"a": "\xff", "x": "%s", "model": "m"}' % long
    assert scan(bad_short) is None and scan_in_pieces(bad_short, [3, 9, 70_000]) is None
    bad_long = b'{"x": "%s\xff\xfe", "model": "m"}' % long
    found = scan_in_pieces(bad_long, [40_000, 80_000])
    assert found is not None and found.model == "m", "the engine refuses that one itself"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_the_heap_keeps_pages_for_the_next_large_body() -> None:
    """`heap.tune` sets both thresholds (on glibc); a large body's pieces then come from a
    heap that is kept, not from fresh pages: after one large body, the next adds no page
    faults of its own. Run in a fresh interpreter, as the proxy's entry point runs it."""
    code = (
        "import resource, sys\n"
        "from vllm_proxy.frontend.bytes import heap\n"
        "if not heap.tune(): sys.exit(3)\n"
        "piece = b'x' * (256 * 1024 + 1)\n"
        "def body(): return [piece[1:] for _ in range(40)]  # malloc'd, as received pieces\n"
        "body()\n"
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt\n"
        "for _ in range(5): body()\n"
        "print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)\n"
    )
    faults = heap_probe(code)
    assert faults < 100, f"{faults} page faults for five 10 MB bodies: the heap gave pages back"


def test_whitespace_pending_across_pieces_is_walked_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A megabyte of spaces arriving in small pieces: while the scan waits for the next
    token, the spaces already in are passed for good, so the regexes are offered each byte
    about once (not the whole run again per piece, which took 36 s of the event loop)."""
    offered = [0]

    class Counting:
        def __init__(self, pattern: Any) -> None:
            self.pattern = pattern

        def match(self, b: Any, pos: int = 0, endpos: int = 2**62) -> Any:
            offered[0] += min(endpos, len(b)) - pos
            return self.pattern.match(b, pos, endpos)

    monkeypatch.setattr(body_mod, "_TOKEN", Counting(body_mod._TOKEN))
    monkeypatch.setattr(body_mod, "_SPACE", Counting(body_mod._SPACE))
    for doc in (
        b'{"model": "m",' + b" " * 1_000_000 + b'"a": 1}',
        b" " * 1_000_000 + b'{"model": "m"}',
        b'{"model": "m"}' + b"\n" * 1_000_000,
    ):
        offered[0] = 0
        found = scan_in_pieces(doc, list(range(1460, len(doc), 1460)))
        assert found is not None and found.model == "m"
        assert offered[0] < 3 * len(doc), f"{offered[0]:,} bytes offered for {len(doc):,}"


def test_a_number_still_open_after_a_kilobyte_is_refused() -> None:
    doc = b'{"n": 1' + b"0" * 5000 + b', "model": "m"}' + b" " * SCAN_MIN_BYTES
    assert scan_in_pieces(doc, list(range(100, len(doc), 100))) is None
    with pytest.raises(BadRequest, match="a number of over 1024 digits"):
        model_of(Pieces([doc]))


def test_a_scan_answers_once_and_keeps_only_its_answer() -> None:
    image = b"QUJD" * (CHECK_STRINGS_BELOW // 2)
    doc = b'{"messages": "%s", "model": "alias"}' % image
    s = Scan(len(doc))
    for i in range(0, len(doc), 8000):
        s.feed(doc[i : i + 8000])
    first = s.result()
    assert first is not None and first.span is not None
    assert doc[first.span[0] : first.span[1]] == b'"alias"'
    again = s.result()
    assert again is first and again.span == first.span, "asking twice changes nothing"
    s.feed(b"late")  # after the answer: ignored
    assert s.result() is first


def test_a_dense_body_is_never_built(monkeypatch: pytest.MonkeyPatch) -> None:
    """8 MB of ``[{},{},...]`` arriving in pieces: the scan holds a window of what it has not
    walked yet, not the document (`json.loads` built 25 times its size)."""
    doc = b'{"model": "m", "x": [' + b"{}," * (8_000_000 // 3) + b"{}]}"
    parts = [doc[i : i + 65536] for i in range(0, len(doc), 65536)]
    tracemalloc.start()
    try:
        s = Scan(len(doc))
        for part in parts:
            s.feed(part)
        parsed = model_of(Pieces(parts), None, s)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert parsed.model == "m"
    assert peak < len(doc) // 8, f"{peak:,} bytes at the peak for a {len(doc):,}-byte body"


def test_a_whole_body_walked_in_steps_is_scanned_as_in_one_go() -> None:
    """`intake` walks a body that is all there in slices (the loop runs between them)."""
    rng = random.Random(7)
    for _ in range(200):
        doc: dict[str, Any] = {k: random_value(rng, 1) for k in ("a", "model", "b", "stream")}
        raw = json.dumps(doc).encode()
        whole = scan(raw)
        s = Scan(len(raw), raw)
        for at in range(0, len(raw) + 7, 7):
            s.walk(at)
        assert same(s.result(), whole), raw


def mutated(rng: random.Random, doc: bytes) -> bytes:
    """`doc` with a byte changed, dropped or added (JSON's own bytes, no encoding change)."""
    at = rng.randrange(len(doc))
    new = bytes([rng.choice(b'{}[],:" \\0123456789.eE+-abcdefnrtluINa\xc3\xff')])
    op = rng.randrange(3)
    if op == 0:
        return doc[:at] + new + doc[at + 1 :]
    if op == 1:
        return doc[:at] + doc[at + 1 :]
    return doc[:at] + new + doc[at:]


def parser_verdict(doc: bytes) -> tuple[bool, Any]:
    """(accepted, model) as `json.loads` (and the proxy's depth limit) decide."""
    try:
        data = json.loads(doc)
    except (ValueError, RecursionError):
        return False, None
    if not isinstance(data, dict):
        return False, None
    model = data.get("model")
    return True, model if isinstance(model, str) else None


def test_random_documents_and_their_mutations_are_refused_as_the_parser_refuses_them() -> None:
    """Valid documents with runs the bulk regexes take (arrays of numbers, of objects, nested
    a few levels), and each with one byte changed, dropped or added: the scan accepts what
    `json.loads` accepts, with the same model, and refuses the rest, whole or in pieces."""
    rng = random.Random(20261126)
    refused = 0
    for _ in range(1500):
        doc: dict[str, Any] = {
            "messages": [random_value(rng, 2) for _ in range(rng.randint(0, 6))],
            "n": [rng.randint(-9, 10**6) for _ in range(rng.randint(0, 5))],
        }
        if rng.random() < 0.8:
            doc["model"] = "m-" + str(rng.randint(0, 9))
        raw = json.dumps(doc, indent=rng.choice([None, 1])).encode()
        for candidate in (raw, mutated(rng, raw), mutated(rng, mutated(rng, raw))):
            accepted, model = parser_verdict(candidate)
            found = scan(candidate)
            assert (found is not None) == accepted, candidate
            if found is not None:
                assert found.model == model, candidate
            cuts = sorted(rng.sample(range(1, len(candidate)), min(len(candidate) - 1, 5)))
            assert same(scan_in_pieces(candidate, cuts), found), (candidate, cuts)
            refused += not accepted
    assert refused > 500


def test_a_body_refused_says_where() -> None:
    doc = b'{"model": "m", "messages": [{"role": "user"}, {"role" "user"}]}'
    s = Scan(len(doc))
    s.feed(doc)
    assert s.result() is None and s.error is not None
    assert s.error.message == "the request body is not valid JSON (at byte 54)"
    assert doc[54:55] == b'"'


def test_structure_too_deep_for_the_bulk_checks_is_refused_as_it_comes() -> None:
    """Values nested deeper than the bulk regexes reach are read token by token; past one
    token per `BYTES_PER_TOKEN` bytes the body is refused, as soon as that is known (the
    reader stops there), so such a body costs the loop a bounded time per byte."""
    deep = b"[" * (BULK_DEPTH + 3) + b"0" + b"]" * (BULK_DEPTH + 3) + b","
    doc = b'{"model": "m", "x": [' + deep * (4_000_000 // len(deep)) + b"0]}"
    s = Scan(len(doc))
    fed = 0
    while s.error is None and fed < len(doc):
        s.feed(doc[fed : fed + 16384])
        fed += 16384
    assert s.error is not None and "more structure than the proxy reads" in s.error.message
    assert fed < len(doc) // 4, f"refused only after {fed:,} of {len(doc):,} bytes"
    ok = b'{"model": "m", "x": [' + deep * 50 + b"0]}"  # a little of it is read, and taken
    assert scan(ok) is not None and scan(ok).model == "m"  # type: ignore[union-attr]


def test_a_refused_body_is_not_kept_alive_by_its_error() -> None:
    """Regression: the scan kept its refusal as an exception and raised it; the traceback held
    the frames that held the scan and the body, a cycle only the garbage collector frees (a
    30 MiB refused body stayed resident until a full collection)."""
    import gc
    import tracemalloc

    from vllm_proxy.errors import BadRequest

    body = b'{"model": "m", "x": [' + b"{}," * 300_000 + b"{}"  # never closes: refused
    enabled = gc.isenabled()
    gc.disable()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        for _ in range(3):
            try:
                model_of(bytes(bytearray(body)))
            except BadRequest as err:
                assert "ends too soon" in err.message
            else:
                raise AssertionError("the body was not refused")
        assert tracemalloc.get_traced_memory()[0] - base < len(body) // 4
    finally:
        tracemalloc.stop()
        if enabled:
            gc.enable()
