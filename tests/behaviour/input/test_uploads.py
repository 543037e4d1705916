"""Form uploads (audio transcription and translation) from hostile clients, through the proxy to
the fake engine (real processes): malformed forms, gzip bombs, slow and stalled uploads, clients
gone mid-upload, one byte per HTTP chunk. Each test ends by checking that nothing is left: no
lease, no queue ticket, no body bytes counted, no spool file."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import pytest
from kit import FakeEngine, RunningProxy, StartProxy, make_config, wait_for
from kit.forms import (
    AUDIO,
    BOUNDARY,
    FORM,
    _peak_rss,
    _peak_rss_reset,
    field,
    form,
    uploads,
)
from kit.leftovers import left_nothing, open_spools, post_raw
from kit.lora import (
    assert_clean_error,
)

from vllm_proxy.engines.states import State

pytestmark = pytest.mark.usefixtures("spool_dir")


B = BOUNDARY.encode()


MODEL_PART = field("model", b"w")


#: A file part's head, its content to follow.
FILE = b'--%b\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n\r\n' % B


CLOSE = b"\r\n--%b--\r\n" % B


def speech_config(tmp_path: Path, **server: Any) -> Any:
    env = FakeEngine(upload_log=tmp_path / "uploads.jsonl", tokens=4).env()
    models = {"whisper": {"model": "org/whisper", "aliases": ["w"], "env": env}}
    return make_config(tmp_path, models, server=server)


HOSTILE_FORMS: list[tuple[str, bytes, str]] = [
    ("a-delimiter-in-the-audio-followed-by-junk",
     MODEL_PART + FILE + b"abc\r\n--" + B + b"junk\r\n" + CLOSE, "text after a boundary"),
    ("no-closing-boundary", MODEL_PART + FILE + AUDIO, "truncated"),
    ("closing-boundary-cut-in-half", MODEL_PART + FILE + AUDIO + CLOSE[:10], "truncated"),
    ("headers-that-never-end", MODEL_PART + b"--" + B + b"\r\nX-A: b\r\n" * 3, "truncated"),
    ("a-20-kib-part-header",
     MODEL_PART + b"--" + B + b"\r\nX-Pad: " + b"p" * 20_000 + b"\r\n\r\nx" + CLOSE, "16384"),
    ("a-header-without-colon", b"--" + B + b"\r\nno colon here\r\n\r\nw" + CLOSE, "colon"),
    ("1001-tiny-parts", MODEL_PART + field("x", b"") * 1000 + CLOSE[2:], "more than 1000"),
    ("model-only-inside-a-nested-multipart",
     b"--" + B + b"\r\nContent-Disposition: form-data; name=\"file\"\r\nContent-Type: "
     b"multipart/mixed; boundary=inner\r\n\r\n--inner\r\nContent-Disposition: form-data; "
     b"name=\"model\"\r\n\r\nw\r\n--inner--" + CLOSE, "'model' is required"),
    ("model-as-a-file-by-filename-star",
     b"--" + B + b"\r\nContent-Disposition: form-data; name=model; filename*=UTF-8''m.txt"
     b"\r\n\r\nw" + CLOSE, "not a file"),
    ("model-twice-second-after-the-file", MODEL_PART + FILE + AUDIO + b"\r\n" + MODEL_PART
     + CLOSE[2:], "more than once"),
    ("lf-line-endings", MODEL_PART.replace(b"\r\n", b"\n") + b"--" + B + b"--\n", "truncated"),
    ("an-empty-body", b"", "no part"),
    ("a-model-longer-than-1-kib", field("model", b"w" * 2000) + CLOSE[2:], "longer than 1024"),
]  # fmt: skip


async def test_hostile_forms_are_openai_shaped_400s_that_reach_no_engine(
    tmp_path: Path, start_proxy: StartProxy, spool_dir: Path
) -> None:
    proxy = await start_proxy(speech_config(tmp_path))
    for name, body, fragment in HOSTILE_FORMS:
        status, data = await post_raw(
            proxy, "/v1/audio/transcriptions", body, **{"Content-Type": FORM}
        )
        assert_clean_error(status, data, 400)
        assert fragment in data["error"]["message"], (name, data)
    # Two boundary parameters: the proxy and vLLM's parser would read different forms.
    body = form(field("model", b"w"), field("file", AUDIO, "a.wav"))
    for content_type in (
        f"{FORM}; boundary=other",
        f"multipart/form-data; boundary=x; {FORM[21:]}",
    ):
        status, data = await post_raw(
            proxy, "/v1/audio/transcriptions", body, **{"Content-Type": content_type}
        )
        assert_clean_error(status, data, 400)
        assert "boundary" in data["error"]["message"]
    assert uploads(tmp_path) == [], "the engine never got a whole body"
    # The boundary's text inside the audio, not after a line break, is audio; a form closed
    # without a final line break, 999 small fields, an epilogue, are forms.
    tricky = b"x" + (b"--" + B + b"--\n\r--" + B + b"\r\n-" + B) * 100
    accepted = [
        MODEL_PART + FILE + tricky + CLOSE,
        MODEL_PART + FILE + AUDIO + CLOSE[:-2],
        MODEL_PART + field("x", b"1") * 998 + FILE + AUDIO + CLOSE + b"epilogue --" + B,
        b"preamble " + b"\r\n--" + B + b"\r\n" + MODEL_PART[len(B) + 4 :] + FILE + b"x" + CLOSE,
    ]
    for body in accepted:
        status, data = await post_raw(
            proxy, "/v1/audio/transcriptions", body, **{"Content-Type": FORM}
        )
        assert status == 200, data
    seen = uploads(tmp_path)
    assert [u["files"]["file"]["length"] for u in seen] == [len(tricky), len(AUDIO), len(AUDIO), 1]
    assert all(u["fields"]["model"] == "whisper" for u in seen)
    await left_nothing(proxy, spool_dir)


async def test_a_gzip_bomb_upload_is_a_413_as_it_inflates(
    tmp_path: Path, start_proxy: StartProxy, spool_dir: Path
) -> None:
    import gzip

    proxy = await start_proxy(speech_config(tmp_path, max_body_mb=1))
    bomb = gzip.compress(FILE + b"\0" * (64 << 20) + CLOSE + MODEL_PART, 9)  # model last: spooled
    assert len(bomb) < 256 * 1024
    began = time.monotonic()
    status, data = await post_raw(
        proxy,
        "/v1/audio/transcriptions",
        bomb,
        **{"Content-Type": FORM, "Content-Encoding": "gzip"},
    )
    assert_clean_error(status, data, 413)
    assert time.monotonic() - began < 10
    assert uploads(tmp_path) == [] and proxy.model("whisper").instances == []
    await left_nothing(proxy, spool_dir)


async def raw_post(
    proxy: RunningProxy,
    head_length: int | None,
    first: bytes,
    path: str = "/v1/audio/transcriptions",
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A form upload sent by hand: its head (with `head_length`, else chunked) and `first`."""
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.server.port)
    framing = f"Content-Length: {head_length}" if head_length else "Transfer-Encoding: chunked"
    writer.write(
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: {FORM}\r\n{framing}\r\n\r\n".encode()
        + first
    )
    await writer.drain()
    return reader, writer


async def answer_of(reader: asyncio.StreamReader, within: float) -> bytes:
    return await asyncio.wait_for(reader.read(65536), within)


async def test_slow_loris_uploads_are_408s_within_body_timeout_s(
    tmp_path: Path, start_proxy: StartProxy, spool_dir: Path
) -> None:
    proxy = await start_proxy(speech_config(tmp_path, body_timeout_s=1))
    began = time.monotonic()
    # Stalls before its model is known; stalls after 512 KiB of audio, spooled, model to come.
    stalled = await raw_post(proxy, 10_000_000, MODEL_PART[:20])
    spooled = await raw_post(proxy, 10_000_000, FILE + AUDIO * 8)
    await wait_for(lambda: bool(open_spools(spool_dir)), what="the audio spooled to a file")
    # Trickles a byte at a time: always sending, never done.
    trickle = await raw_post(proxy, 10_000_000, b"")
    for byte in MODEL_PART[:30]:
        trickle[1].write(bytes([byte]))
        await trickle[1].drain()
        if trickle[0].at_eof() or trickle[0]._buffer:  # (answered already)
            break
        await asyncio.sleep(0.1)  # the client's pace, not a wait for the proxy
    for reader, writer in (stalled, spooled, trickle):
        answer = await answer_of(reader, 10)
        writer.close()
        assert answer.startswith(b"HTTP/1.1 408"), answer[:300]
        assert b'"code": "request_timeout"' in answer and b"body_timeout_s" in answer
    assert time.monotonic() - began < 6
    assert proxy.model("whisper").instances == []
    await left_nothing(proxy, spool_dir)


async def test_stalled_uploads_spool_at_most_max_spool_mb_in_all(
    tmp_path: Path, start_proxy: StartProxy, spool_dir: Path
) -> None:
    """Uploads with their model after the file, stalled mid-file, spooled without a bound in
    all (20 of them: 613 MiB with ``max_bodies_mb: 64``; RAM where the temporary directory is
    a tmpfs). The spool files of all uploads are bounded by ``max_spool_mb``: past it 503 +
    Retry-After, while an upload that names its model first still goes; a stalled client's
    bytes are given back when it goes."""
    proxy = await start_proxy(speech_config(tmp_path, max_body_mb=2, max_spool_mb=2))
    spools = proxy.server.runtime.proxy.spools
    stalled = []
    for _ in range(2):  # 1.1 MiB each, 0.9 MiB of it spooled
        stalled.append(await raw_post(proxy, 2_000_000, FILE + AUDIO * 18))
    await wait_for(lambda: spools.held >= 2 * 800 * 1024, what="two uploads spooled")
    reader, over = await raw_post(proxy, 2_000_000, FILE + AUDIO * 18)
    try:
        answer = await answer_of(reader, 10)
        assert answer.startswith(b"HTTP/1.1 503"), answer[:300]
        assert b"Retry-After" in answer and b'"code": "upload_spool_full"' in answer
        assert b"server.max_spool_mb" in answer
    finally:
        over.close()
    assert spools.held <= 2 * 1024 * 1024
    body = MODEL_PART + FILE + AUDIO + CLOSE  # the model first: never spooled
    status, data = await post_raw(proxy, "/v1/audio/transcriptions", body, **{"Content-Type": FORM})
    assert status == 200, data
    for _, writer in stalled:
        writer.close()
    await wait_for(lambda: spools.held == 0, what="the spooled bytes given back")
    await left_nothing(proxy, spool_dir)


async def test_a_client_gone_mid_upload_leaves_no_spool_file_no_lease_and_no_ticket(
    tmp_path: Path, start_proxy: StartProxy, spool_dir: Path
) -> None:
    cfg = speech_config(tmp_path)
    cfg.models["whisper"].env.update(FakeEngine(startup_delay=1.5).env())
    proxy = await start_proxy(cfg)
    model = proxy.model("whisper")
    # 1. While its audio is spooled before the model is known.
    _, writer = await raw_post(proxy, 10_000_000, FILE + AUDIO * 8)
    await wait_for(lambda: bool(open_spools(spool_dir)), what="the audio spooled")
    writer.transport.abort()
    await left_nothing(proxy, spool_dir)
    # 2. While the engine it needs starts (chunked, model first).
    chunk = MODEL_PART + FILE + AUDIO
    _, writer = await raw_post(proxy, None, b"%x\r\n%b\r\n" % (len(chunk), chunk))
    await wait_for(lambda: model.state() is State.STARTING, what="the engine starting")
    writer.transport.abort()
    await left_nothing(proxy, spool_dir)
    await wait_for(lambda: model.serving() is not None, what="the start went on")
    # 3. Spooled, then passed on under the lease, and gone half-way.
    first = FILE + AUDIO * 8 + b"\r\n" + MODEL_PART + FILE.replace(b'"file"', b'"more"')
    _, writer = await raw_post(proxy, 20_000_000, first + AUDIO * 16)
    inst = model.serving()
    assert inst is not None
    await wait_for(lambda: inst.leases == 1, what="the upload under its lease")
    writer.transport.abort()
    await left_nothing(proxy, spool_dir)
    assert uploads(tmp_path) == []
    good = form(field("model", b"w"), field("file", AUDIO, "a.wav"))
    status, data = await post_raw(proxy, "/v1/audio/transcriptions", good, **{"Content-Type": FORM})
    assert status == 200, data
    await left_nothing(proxy, spool_dir)


async def test_bodies_sent_one_byte_per_http_chunk_cost_neither_memory_nor_minutes(
    tmp_path: Path, start_proxy: StartProxy, spool_dir: Path
) -> None:
    """Each HTTP chunk was read as a piece of its own: a byte per chunk made a Python object
    of every byte (a 2 MB JSON body held ~26 MiB), and a scan step of every byte of a form
    (2 MB took ~18 s of the proxy's CPU). The bound is on CPU seconds of this process (the
    proxy runs in it), which a busy machine does not stretch as it does wall time."""
    proxy = await start_proxy(speech_config(tmp_path))
    size = 2 * 1024 * 1024
    json_body = json.dumps({"prompt": "x" * size, "model": "nope"}).encode()
    form_body = FILE + b"x" * size + b"\r\n" + field("model", b"nope") + CLOSE[2:]
    for path, content_type, body in (
        ("/v1/completions", "application/json", json_body),
        ("/v1/audio/transcriptions", FORM, form_body),
    ):
        wire = b"".join(b"1\r\n%c\r\n" % c for c in body) + b"0\r\n\r\n"
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.server.port)
        _peak_rss_reset()
        before, began = _peak_rss(), time.process_time()
        writer.write(
            f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: {content_type}\r\n"
            "Transfer-Encoding: chunked\r\n\r\n".encode()
        )
        for i in range(0, len(wire), 1 << 16):
            writer.write(wire[i : i + (1 << 16)])
            await writer.drain()
        answer = await answer_of(reader, 60)
        took, grown = time.process_time() - began, _peak_rss() - before
        writer.close()
        assert answer.startswith(b"HTTP/1.1 404"), answer[:300]
        assert grown < 8 * 2**20, f"{path}: the peak RSS grew by {grown / 2**20:.1f} MiB"
        assert took < 8, f"{path}: {took:.1f} CPU seconds"
    await left_nothing(proxy, spool_dir)
