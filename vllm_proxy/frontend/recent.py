"""The last requests on the model routes, for the console and ``vllm-proxy ctl``: a bounded ring
of what the access log says of each (no bodies), filtered by model and status.

Bodies are kept only while an operator has turned capture on for one model (`Capture`): for a
bounded time, count and size, and never past a restart.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

#: Requests kept.
MAX_RECENT = 500
#: What one capture may keep at most: seconds, bodies, bytes per body.
MAX_CAPTURE_S = 3600.0
MAX_CAPTURE_COUNT = 100
MAX_CAPTURE_BYTES = 64 * 1024


class Capture:
    """Request bodies kept for one model until `until` (wall clock), at most `count` of them,
    each cut at `max_bytes`."""

    __slots__ = ("count", "kept", "max_bytes", "model", "until")

    def __init__(self, model: str, seconds: float, count: int, max_bytes: int) -> None:
        self.model = model
        self.until = time.time() + seconds
        self.count = count
        self.max_bytes = max_bytes
        self.kept = 0

    def active(self) -> bool:
        return self.kept < self.count and time.time() < self.until

    def status(self) -> dict[str, Any]:
        return {"model": self.model, "until": self.until, "max_count": self.count,
                "kept": self.kept, "max_bytes": self.max_bytes,
                "active": self.active()}  # fmt: skip


class Recent:
    """The ring of recent requests; `seq` grows by one per request."""

    def __init__(self, size: int = MAX_RECENT) -> None:
        self.ring: deque[dict[str, Any]] = deque(maxlen=size)
        self.seq = 0
        self.capture: Capture | None = None

    def add(self, entry: dict[str, Any], body: bytes | None = None) -> None:
        self.seq += 1
        entry["seq"] = self.seq
        cap = self.capture
        if body is not None and cap is not None and cap.model == entry["model"] and cap.active():
            cap.kept += 1
            entry["body"] = body[: cap.max_bytes].decode("utf-8", "replace")
            entry["body_truncated"] = len(body) > cap.max_bytes
        self.ring.append(entry)

    def wants_body(self, model: str) -> bool:
        """Whether a request for `model` should have its body kept (capture on for it)."""
        cap = self.capture
        return cap is not None and cap.model == model and cap.active()

    def start_capture(self, model: str, seconds: float, count: int, max_bytes: int) -> Capture:
        self.capture = Capture(
            model,
            min(max(seconds, 1.0), MAX_CAPTURE_S),
            min(max(count, 1), MAX_CAPTURE_COUNT),
            min(max(max_bytes, 1), MAX_CAPTURE_BYTES),
        )
        return self.capture

    def stop_capture(self) -> None:
        self.capture = None

    def query(
        self, model: str | None = None, status: str | None = None, limit: int = 100,
        after: int = 0,
    ) -> list[dict[str, Any]]:  # fmt: skip
        """The newest first, at most `limit`, of those after `after` that match: `status` is a
        code (``200``) or a class (``2xx``, ``4xx``, ``5xx``)."""
        out: list[dict[str, Any]] = []
        for entry in reversed(self.ring):
            if entry["seq"] <= after or len(out) >= limit:
                break
            if model and entry["model"] != model:
                continue
            if status and not _status_matches(entry["status"], status):
                continue
            out.append(entry)
        return out


def _status_matches(code: int, wanted: str) -> bool:
    if len(wanted) == 3 and wanted.endswith("xx") and wanted[0].isdigit():
        return str(code).startswith(wanted[0])
    return str(code) == wanted
