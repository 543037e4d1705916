"""`vllm-proxy --config config.yaml`: exit 0 after a clean shutdown; 2 on a bad config, and on
a state dir or port that another process holds (each with one line naming the key to change).

`vllm-proxy ctl ...` operates a running proxy over its admin API (`ctl`)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time

from .config import apply_overrides, load_config
from .errors import ConfigError

EXIT_CONFIG = 2


class JsonFormatter(logging.Formatter):
    """One JSON object per line, for log shippers."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def setup_logging(level: str, fmt: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="vllm-proxy", description="OpenAI-compatible proxy that runs vLLM engines on demand"
    )
    p.add_argument("--config", "-c", required=True, help="path to the YAML configuration")
    p.add_argument("--host", help="override server.host")
    p.add_argument("--port", type=int, help="override server.port")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--log-format", default="text", choices=["text", "json"])
    p.add_argument("--check", action="store_true", help="validate the config and exit")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    given = sys.argv[1:] if argv is None else argv
    if given[:1] == ["ctl"]:  # the operator's client of a running proxy (`ctl`)
        from .ctl import main as ctl

        return ctl(given[1:])
    args = parse_args(argv)
    setup_logging(args.log_level, args.log_format)
    try:
        overrides = {k: v for k, v in (("host", args.host), ("port", args.port)) if v is not None}
        config = apply_overrides(load_config(args.config), overrides)
    except ConfigError as err:
        print(f"vllm-proxy: {err}", file=sys.stderr)
        return EXIT_CONFIG
    import uvloop

    from .app import check_memory, serve
    from .frontend.bytes import heap

    if args.check:
        try:  # also: does every model fit on a device it may use (as at start)?
            memory = check_memory(config)
        except ConfigError as err:
            print(f"vllm-proxy: {err}", file=sys.stderr)
            return EXIT_CONFIG
        print(f"{args.config}: OK, {len(config.models)} model(s); GPU memory: {memory}")
        return 0

    heap.tune()
    try:
        return uvloop.run(serve(config, args.config, overrides))
    except ConfigError as err:  # found at start-up: a model larger than any GPU, a port in use
        print(f"vllm-proxy: {err}", file=sys.stderr)
        return EXIT_CONFIG


if __name__ == "__main__":
    sys.exit(main())
