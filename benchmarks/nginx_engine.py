"""A static "engine" for the benchmarks: nginx answering every POST with one fixed JSON body.

vllm-proxy only forwards to engines it starts itself, so to put it in front of the same fast
upstream as the other proxies the benchmark configures this script as the engine command of one
model. The proxy runs it like vLLM (``--model M --served-model-name N --host H --port P``); it
writes an nginx config into ``$NGINX_ENGINE_DIR/<port>/`` and execs ``nginx -g 'daemon off;'``
(one worker, access log off), which:

* answers ``GET /health`` with 200 (the proxy's readiness probe);
* answers every other request with 200 and the body in the file ``$NGINX_ENGINE_BODY``
  (an OpenAI ``chat.completion`` object), ``Content-Type: application/json``.

The benchmark then sends the "direct", nginx ``proxy_pass`` and LiteLLM requests to the very same
nginx process, found from the proxy's log line ``ready on port N``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import nginx_conf

SERVER = """\
    server {{
        listen {host}:{port} backlog=4096;
        location = /health {{ return 200; }}
        location / {{
            default_type application/json;
            return 200 '{body}';
        }}
    }}
"""


def server_block(host: str, port: int, body: str) -> str:
    if "'" in body or "$" in body or "\\" in body:
        raise ValueError("the static body must not contain ', $ or \\ (nginx string syntax)")
    return SERVER.format(host=host, port=port, body=body)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="nginx_engine")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    args, _ = p.parse_known_args(argv)  # --model / --served-model-name are accepted and ignored
    base = os.environ.get("NGINX_ENGINE_DIR")
    body_file = os.environ.get("NGINX_ENGINE_BODY")
    if not base or not body_file:
        print("nginx_engine: NGINX_ENGINE_DIR and NGINX_ENGINE_BODY must be set", file=sys.stderr)
        return 2
    directory = Path(base) / str(args.port)
    directory.mkdir(parents=True, exist_ok=True)
    body = Path(body_file).read_text().strip()
    conf = nginx_conf.write(directory, server_block(args.host, args.port, body))
    nginx = os.environ.get("NGINX_BIN", "nginx")
    sys.stdout.flush()
    os.execvp(nginx, nginx_conf.argv(directory, conf, nginx))
    return 127  # pragma: no cover - execvp does not return


if __name__ == "__main__":
    sys.exit(main())
