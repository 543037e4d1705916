"""`form.FormScan` and `form.Rename` without an event loop: forms cut at every byte, random
forms against what was put in them, and the refusals."""

from __future__ import annotations

import random

import pytest

from vllm_proxy.errors import BadRequest
from vllm_proxy.frontend.bytes.form import MAX_PARTS, FormScan, Rename, boundary_of, model_field

B = b"b0und"


def part(name: bytes, value: bytes, filename: bytes | None = None, pad: bytes = b"") -> bytes:
    disposition = b'form-data; name="' + name + b'"'
    if filename is not None:
        disposition += b'; filename="' + filename + b'"'
    return b"--" + B + pad + b"\r\nContent-Disposition: " + disposition + b"\r\n\r\n" + value


def body(*parts: bytes, preamble: bytes = b"", epilogue: bytes = b"") -> bytes:
    inner = b"\r\n".join(parts)
    return preamble + inner + b"\r\n--" + B + b"--" + epilogue


def scanned(data: bytes, cuts: list[int] | None = None) -> FormScan:
    scan = FormScan(B)
    at = 0
    for cut in [*(cuts or []), len(data)]:
        scan.feed(data[at:cut])
        at = cut
    scan.end()
    return scan


def test_the_model_is_found_wherever_the_pieces_are_cut() -> None:
    audio = b"\r\n--b0un\r\n-" * 50  # almost a delimiter, many times
    data = body(part(b"file", audio, b"a.wav"), part(b"model", b"whisper-1"), part(b"x", b"1"))
    start = data.index(b"whisper-1")
    for cut in range(len(data) + 1):
        for second in (cut, min(cut + 1, len(data)), min(cut + 7, len(data))):
            scan = scanned(data, [cut, second])
            assert (scan.model, scan.span) == ("whisper-1", (start, start + 9)), (cut, second)
            assert scan.first == 0


def test_random_forms_give_back_what_was_put_in_them() -> None:
    rng = random.Random(24)
    for _ in range(300):
        fields = [
            (b"f%d" % i, rng.randbytes(rng.randint(0, 300))) for i in range(rng.randint(0, 4))
        ]
        fields = [(n, v.replace(b"\r\n--", b"\r\n-")) for n, v in fields]  # no delimiter inside
        fields.insert(rng.randint(0, len(fields)), (b"model", b"m-" + str(rng.random()).encode()))
        pad = rng.choice([b"", b" ", b"\t "])
        parts = [
            part(n, v, b"x.bin" if n != b"model" and rng.random() < 0.5 else None, pad)
            for n, v in fields
        ]
        preamble = rng.choice([b"", b"This is a preamble.\r\n"])
        data = body(*parts, preamble=preamble, epilogue=rng.choice([b"", b"\r\n", b"\r\nbye"]))
        cuts = sorted(rng.sample(range(len(data) + 1), rng.randint(0, 12)))
        scan = scanned(data, cuts)
        value = dict(fields)[b"model"]
        assert scan.model == value.decode() and scan.span is not None
        assert data[scan.span[0] : scan.span[1]] == value
        assert scan.first == len(preamble) and scan.parts == len(fields) and scan.closed


@pytest.mark.parametrize(
    ("data", "fragment"),
    [
        (body(part(b"model", b"a"))[:-2], "truncated"),
        (body(part(b"model", b"a")).replace(b"--" + B + b"--", b""), "truncated"),
        (body(part(b"model", b"a", b"m.txt")), "not a file"),
        (body(part(b"model", b"")), "'model' is required"),
        (body(part(b"model", b"a"), part(b"model", b"b")), "more than once"),
        (body(part(b"model", b"\xc3")), "not UTF-8"),
        (body(part(b"model", b"x" * 1025)), "longer than 1024"),
        (body(part(b"model", b"a")).replace(B + b"\r\n", B + b"junk\r\n", 1), "text after"),
        (b"--" + B + b"\r\nNo colon here\r\n\r\nv\r\n--" + B + b"--", "without a colon"),
        (b"--" + B + b"\r\nX: " + b"y" * 20000, "headers are longer"),
        (body(*[part(b"f", b"")] * (MAX_PARTS + 1)), "more than 1000 parts"),
        (b"nothing like a form", "no part"),
    ],
)
def test_refusals(data: bytes, fragment: str) -> None:
    for cuts in ([], list(range(1, len(data), 3))):
        with pytest.raises(BadRequest) as refused:
            scanned(data, cuts)
        assert fragment in refused.value.message


def test_a_form_without_model_scans_whole_with_no_model() -> None:
    scan = scanned(body(part(b"file", b"abc", b"a")))
    assert (scan.model, scan.span, scan.first) == (None, None, 0)


def test_rename_replaces_or_inserts_whatever_the_pieces() -> None:
    data = b"0123456789"
    for rename, expected in (
        (Rename(3, 6, b"XY"), b"012XY6789"),
        (Rename(3, 3, b"ins"), b"012ins3456789"),
        (Rename(0, 10, b""), b""),
    ):
        for a in range(11):
            for b in range(a, 11):
                pieces = [data[:a], data[a:b], data[b:]]
                out, at = b"", 0
                for piece in pieces:
                    if piece:
                        out += b"".join(rename.apply(piece, at))
                    at += len(piece)
                assert out == expected, (rename.start, rename.end, a, b)
        assert rename.growth == len(expected) - len(data)


def test_an_inserted_model_field_is_read_as_one() -> None:
    data = body(part(b"file", b"abc", b"a"), preamble=b"pre\r\n")
    scan = scanned(data)
    assert scan.first is not None
    renamed = b"".join(Rename(scan.first, scan.first, model_field(B, "m")).apply(data, 0))
    assert scanned(renamed).model == "m"


def test_boundaries() -> None:
    assert boundary_of("multipart/form-data; boundary=abc") == b"abc"
    assert boundary_of('Multipart/Form-Data; charset=utf-8; BOUNDARY="a b:c"') == b"a b:c"
    for bad in ("multipart/form-data", "multipart/form-data; boundary=", "x; boundary=" + "a" * 71):
        with pytest.raises(BadRequest):
            boundary_of(bad)
