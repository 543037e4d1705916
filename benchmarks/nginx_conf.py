"""The nginx configs of the benchmarks, one worker each, every file under one folder: the
static engine (`nginx_engine.py`) and nginx ``proxy_pass`` (`servers.start_nginx_proxy`)."""

from __future__ import annotations

from pathlib import Path

CONF = """\
worker_processes 1;
{main}pid {d}/nginx.pid;
error_log {d}/error.log warn;
events {{ worker_connections 16384; multi_accept on; }}
http {{
    access_log off;
    client_body_temp_path {d}/client_body;
    proxy_temp_path {d}/proxy;
    fastcgi_temp_path {d}/fastcgi;
    uwsgi_temp_path {d}/uwsgi;
    scgi_temp_path {d}/scgi;
    keepalive_requests 10000000;
    keepalive_timeout 75s;
{http}}}
"""


def write(folder: Path, http: str, main: str = "") -> Path:
    """``folder/nginx.conf`` with the `http` block's own lines (servers, upstreams) and the
    top level's `main` lines; returns its path."""
    conf = folder / "nginx.conf"
    conf.write_text(CONF.format(d=folder, main=main, http=http))
    return conf


def argv(folder: Path, conf: Path, nginx: str = "nginx") -> list[str]:
    """nginx in the foreground with `conf`, its prefix and error log in `folder`."""
    return [nginx, "-p", str(folder), "-e", str(folder / "error.log"), "-c", str(conf),
            "-g", "daemon off;"]  # fmt: skip
