"""``vllm-proxy ctl``: the console's actions and views for an operator on SSH, over the admin API
of a running proxy (no access to its files or processes needed).

    vllm-proxy ctl [--url URL] [--key KEY] ps | top | requests | reload
    vllm-proxy ctl logs [-f] [--tail N] [--instance ID] MODEL
    vllm-proxy ctl start | wake | stop | drain MODEL
    vllm-proxy ctl sleep [--level 1|2] MODEL

The URL and the admin key come from the flags, else from ``VLLM_PROXY_URL`` (default
``http://127.0.0.1:8080``) and ``VLLM_PROXY_ADMIN_KEY``. Exit status: 0 done, 1 the proxy
refused (its message is printed), 2 it could not be reached or the command line is wrong.

Standard library only: it runs from the proxy's venv, or copied anywhere with Python 3.11.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import IO, Any
from urllib.parse import quote, urlencode

DEFAULT_URL = "http://127.0.0.1:8080"
URL_ENV = "VLLM_PROXY_URL"
KEY_ENV = "VLLM_PROXY_ADMIN_KEY"
#: How long one call may take: starts and drains answer when done, which takes a while.
TIMEOUT_S = 900.0
EXIT_REFUSED = 1
EXIT_UNREACHABLE = 2


class Refused(Exception):
    """The proxy answered with an error (its message)."""


class Client:
    """The admin API of one proxy."""

    def __init__(self, url: str, key: str | None) -> None:
        self.url = url.rstrip("/")
        self.key = key

    def _open(self, method: str, path: str, timeout: float | None = TIMEOUT_S) -> Any:
        req = urllib.request.Request(self.url + path, method=method)
        if self.key:
            req.add_header("Authorization", f"Bearer {self.key}")
        try:
            return urllib.request.urlopen(req, timeout=timeout)
        except urllib.error.HTTPError as err:
            raise Refused(_message(err)) from None

    def get(self, path: str) -> Any:
        with self._open("GET", path) as resp:
            return json.load(resp)

    def post(self, path: str) -> Any:
        with self._open("POST", path) as resp:
            return json.load(resp)

    def text(self, path: str) -> str:
        with self._open("GET", path) as resp:
            return str(resp.read().decode("utf-8", "replace"))

    def stream(self, path: str) -> Iterator[bytes]:
        with self._open("GET", path, timeout=None) as resp:
            while True:
                chunk = resp.read1(65536)
                if not chunk:
                    return
                yield chunk


def _message(err: urllib.error.HTTPError) -> str:
    try:
        body = json.loads(err.read())
        text = str(body["error"]["message"])
    except (ValueError, KeyError, TypeError):
        text = err.reason or "error"
    hint = ""
    if err.code == 401:
        hint = f" (give the admin key with --key or {KEY_ENV})"
    return f"HTTP {err.code}: {text}{hint}"


# -- tables -----------------------------------------------------------------------------------


def _mib(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v / 1024:.1f}G" if v >= 10240 else f"{round(v)}M"


def _dur(s: float | None) -> str:
    if s is None:
        return "-"
    s = int(max(0, s))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


def _ago(now: float, epoch: float | None) -> str:
    return "never" if not epoch else _dur(now - epoch) + " ago"


def table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows
    )


def ps_table(data: dict[str, Any]) -> str:
    """Models and their instances, as the console shows them."""
    now = float(data["proxy"]["now"])
    rows = [["MODEL / INSTANCE", "STATE", "PID:PORT", "DEVICES", "MEMORY", "LEASES", "QUEUE",
             "LAST USED", "UPTIME", "RESTARTS", "LAST ERROR"]]  # fmt: skip
    for m in data["models"]:
        tags = [t for t in ("pinned", "draining", "removed") if m.get(t)]
        est = (m.get("memory") or {}).get("estimate_mb")
        rows.append([m["name"] + (f" [{','.join(tags)}]" if tags else ""), m["state"], "", "",
                     _mib(est), str(m["leases"]), str(m["queue"]), _ago(now, m["last_used"]),
                     "", str(m["restarts"]), (m.get("last_error") or "")[:60]])  # fmt: skip
        for i in m["instances"]:
            state = i["state"] + (f" L{i['sleep_level']}" if i.get("sleep_level") else "")
            where = i["port"] or (i["socket"] or "").rsplit("/", 1)[-1] or "-"
            measured = (i.get("memory") or {}).get("measured_mb")
            rows.append([f"  {i['id']}", state, f"{i['pid'] or '-'}:{where}",
                         ",".join(map(str, i["devices"])) or "-", _mib(measured),
                         str(i["leases"]), "", _ago(now, i["last_used"]), _dur(i["uptime_s"]),
                         "", (i.get("last_error") or "")[:60]])  # fmt: skip
    gpus = [f"GPU {g['id']}: {_mib(g['used_mb'])} / {_mib(g['total_mb'])} used"
            for g in data["gpus"]]  # fmt: skip
    p = data["proxy"]
    head = f"vllm-proxy {p['version']}  up {_dur(p['uptime_s'])}  active {p['active_requests']}"
    return "\n".join([head, *gpus, "", table(rows)])


def _printable(text: str) -> str:
    """A client's text (its path) without the control characters a terminal would obey."""
    return "".join(c if c.isprintable() else "?" for c in text)


def requests_table(rows: list[dict[str, Any]]) -> str:
    out = [["TIME", "REQUEST ID", "MODEL", "KEY", "ROUTE", "STATUS", "WAIT", "TTFT", "IN", "OUT",
            "TOK/S", "DURATION"]]  # fmt: skip

    def s(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f}s"

    for r in rows:
        out.append([time.strftime("%H:%M:%S", time.localtime(r["t"])), r["id"], r["model"],
                    r["key"] or "-", _printable(r["route"]), str(r["status"]), s(r["wait_s"]),
                    s(r["ttft_s"]), str(r["tokens_in"] or "-"), str(r["tokens_out"] or "-"),
                    str(r["tokens_per_s"] or "-"), s(r["duration_s"])])  # fmt: skip
    return table(out)


# -- commands ---------------------------------------------------------------------------------


def _model_path(name: str) -> str:
    return "/admin/models/" + quote(name, safe="")


def _instance_of(client: Client, model: str, wanted: str | None) -> str:
    row = client.get(_model_path(model))
    ids = [i["id"] for i in row["instances"]]
    if row.get("last_instance"):
        ids.append(row["last_instance"]["id"])
    if wanted is not None:
        if wanted not in ids:
            raise Refused(f"model '{row['name']}' has no instance '{wanted}' (it has: "
                          f"{', '.join(ids) or 'none'})")  # fmt: skip
        return wanted
    if not ids:
        raise Refused(f"model '{row['name']}' has no engine and none ended yet: no log")
    return str(ids[0])


def run(args: argparse.Namespace, client: Client, out: IO[str]) -> None:
    cmd = args.command
    if cmd == "ps":
        print(ps_table(client.get("/admin/models")), file=out)
    elif cmd == "top":
        shown = 0
        while args.count is None or shown < args.count:
            if shown:
                time.sleep(args.interval)  # the refresh period of a terminal view
            data = client.get("/admin/models")
            recent = client.get("/admin/requests?limit=10")["requests"]
            if out.isatty():
                out.write("\x1b[H\x1b[2J")
            print(ps_table(data), "", "recent requests:", requests_table(recent), sep="\n",
                  file=out)  # fmt: skip
            out.flush()
            shown += 1
    elif cmd == "requests":
        query = {k: v for k, v in (("model", args.model), ("status", args.status)) if v}
        query["limit"] = str(args.limit)
        rows = client.get("/admin/requests?" + urlencode(query))["requests"]
        print(requests_table(rows), file=out)
    elif cmd == "reload":
        print(json.dumps(client.post("/admin/reload"), indent=2), file=out)
    elif cmd == "logs":
        iid = _instance_of(client, args.model, args.instance)
        path = f"/admin/instances/{quote(iid, safe='')}/log?tail={args.tail}"
        if not args.follow:
            out.write(client.text(path))
            return
        for chunk in client.stream(path + "&follow=1"):
            out.write(chunk.decode("utf-8", "replace"))
            out.flush()
    else:
        action = {"start": "load", "stop": "stop", "drain": "drain", "wake": "wake"}.get(cmd)
        path = _model_path(args.model) + "/" + (action or "sleep")
        if cmd == "sleep" and args.level:
            path += f"?level={args.level}"
        row = client.post(path)
        level = [i.get("sleep_level") for i in row["instances"] if i.get("sleep_level")]
        shown = row["state"] + (f" (level {level[0]})" if level else "")
        print(f"{row['name']}: {shown}", file=out)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="vllm-proxy ctl", description="operate a running vllm-proxy over its admin API"
    )
    p.add_argument("--url", default=os.environ.get(URL_ENV, DEFAULT_URL),
                   help=f"the proxy (default ${URL_ENV} or {DEFAULT_URL})")  # fmt: skip
    p.add_argument("--key", default=os.environ.get(KEY_ENV),
                   help=f"an admin API key (default ${KEY_ENV})")  # fmt: skip
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("ps", help="models and instances")
    top = sub.add_parser("top", help="ps and the last requests, refreshed")
    top.add_argument("--interval", type=float, default=2.0)
    top.add_argument("--count", type=int, help="refreshes, then exit (default: until ^C)")
    req = sub.add_parser("requests", help="the recent requests")
    req.add_argument("--model")
    req.add_argument("--status", help="a code (404) or a class (5xx)")
    req.add_argument("--limit", type=int, default=50)
    sub.add_parser("reload", help="re-read the config file")
    logs = sub.add_parser("logs", help="an engine's log")
    logs.add_argument("-f", "--follow", action="store_true", help="keep printing new lines")
    logs.add_argument("--tail", type=int, default=100)
    logs.add_argument("--instance", help="this instance (default: the model's first)")
    logs.add_argument("model")
    for name, what in [("start", "start an engine unless one serves"),
                       ("wake", "wake the sleeping engine"),
                       ("stop", "stop every engine now (requests in flight are cut)"),
                       ("drain", "stop every engine once its requests are done")]:  # fmt: skip
        sub.add_parser(name, help=what).add_argument("model")
    sleep = sub.add_parser("sleep", help="put the running engines to sleep")
    sleep.add_argument("--level", type=int, choices=[1, 2])
    sleep.add_argument("model")
    return p


def main(argv: list[str] | None = None, out: IO[str] | None = None) -> int:
    args = parser().parse_args(argv)
    out = out or sys.stdout
    client = Client(args.url, args.key)
    try:
        run(args, client, out)
    except Refused as err:
        print(f"vllm-proxy ctl: {err}", file=sys.stderr)
        return EXIT_REFUSED
    except (urllib.error.URLError, OSError) as err:
        reason = getattr(err, "reason", err)
        print(f"vllm-proxy ctl: cannot reach {client.url}: {reason}", file=sys.stderr)
        return EXIT_UNREACHABLE
    except KeyboardInterrupt:
        return 0
    return 0
