"""A browser cannot drive the proxy for a page of another site: cross-origin admin changes are
refused, and with ``server.allowed_hosts`` a Host outside the list (DNS rebinding) is too."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from kit import RunningProxy, StartProxy, make_config, write_config

from vllm_proxy.errors import ConfigError
from vllm_proxy.frontend.gate import parse_hosts

#: What a cross-site ``<form method=post action=http://proxy/admin/...>`` sends.
FORM = {"Content-Type": "application/x-www-form-urlencoded"}


async def unload(proxy: RunningProxy, headers: dict[str, str]) -> tuple[int, dict]:
    async with proxy.http.post(
        proxy.url + "/admin/models/m1/unload?timeout=1", data=b"x=1", headers=headers
    ) as r:
        return r.status, await r.json()


async def test_a_cross_site_form_post_cannot_unload_a_model(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    proxy = await start_proxy(make_config(tmp_path, server={"admin_open": True}))
    assert (await proxy.chat("m1")).status == 200
    serving = proxy.instance("m1")
    host = f"127.0.0.1:{proxy.server.port}"
    for refused in (
        {"Origin": "http://evil.example"},
        {"Origin": f"http://evil.example:{proxy.server.port}"},
        {"Origin": f"http://127.0.0.1:{proxy.server.port + 1}"},
        {"Origin": "null"},  # a sandboxed frame, a local file
        {"Sec-Fetch-Site": "cross-site"},  # a browser that sent no Origin
        {"Sec-Fetch-Site": "same-site"},  # another origin of the same site
    ):
        status, body = await unload(proxy, {**FORM, **refused})
        assert status == 403, refused
        assert body["error"]["code"] == "cross_origin"
        assert body["error"]["type"] == "permission_error"
    assert proxy.model("m1").serving() is serving, "still loaded, same instance"
    # Reading stays possible (a browser keeps another origin's page from the answer), and a
    # page of the proxy's own origin, or a script with no Origin at all, may change things.
    async with proxy.http.get(
        proxy.url + "/admin/models", headers={"Origin": "http://evil.example"}
    ) as r:
        assert r.status == 200
    own = {"Origin": f"http://{host}", "Sec-Fetch-Site": "same-origin"}
    assert (await unload(proxy, own))[0] == 200
    assert proxy.model("m1").serving() is None
    assert (await proxy.chat("m1")).status == 200
    assert (await unload(proxy, {}))[0] == 200


async def test_allowed_hosts_refuse_other_host_headers_but_not_health(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    hosts = ["proxy.example", "Other.Example:8443", "[::1]"]
    proxy = await start_proxy(
        make_config(tmp_path, server={"allowed_hosts": hosts, "admin_open": True})
    )

    async def status(path: str, host: str, method: str = "GET") -> int:
        async with proxy.http.request(method, proxy.url + path, headers={"Host": host}) as r:
            if r.status == 421:
                body = await r.json()
                assert body["error"]["code"] == "host_not_allowed"
                assert "server.allowed_hosts" in body["error"]["message"]
                assert "X-Request-ID" in r.headers
            return r.status

    for good in ("proxy.example", "proxy.example:8080", "PROXY.example.", "other.example:8443"):
        assert await status("/v1/models", good) == 200, good
    assert await status("/v1/models", "[::1]:9000") == 200
    for bad in (f"127.0.0.1:{proxy.server.port}", "evil.example", "other.example:80", "x@y"):
        assert await status("/v1/models", bad) == 421, bad
        assert await status("/metrics", bad) == 421, bad
    # DNS rebinding: a page of evil.example whose name now points here sends its own Host.
    assert await status("/admin/models/m1/load", "evil.example", "POST") == 421
    assert proxy.model("m1").serving() is None, "nothing was started"
    assert await status("/health", "evil.example") == 200, "load balancers probe by address"


@pytest.mark.parametrize("entry", ["http://proxy.example", "proxy.example:port", "", "a/b"])
def test_a_bad_allowed_hosts_entry_is_a_config_error(entry: str) -> None:
    with pytest.raises(ConfigError, match=r"server\.allowed_hosts\.1: "):
        parse_hosts(["ok.example", entry])


async def test_a_reload_applies_allowed_hosts_and_metrics_keys_at_once(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    path = tmp_path / "config.yaml"
    data = make_config(tmp_path, server={"admin_api_keys": ["adm"]}).model_dump(
        mode="json", exclude_none=True
    )
    write_config(path, data)
    proxy = await start_proxy.file(path)
    http, url = proxy.http, proxy.url
    admin = {"Authorization": "Bearer adm", "Host": "proxy.example"}

    async def status(path: str, **headers: str) -> int:
        async with http.get(url + path, headers=headers) as r:
            return r.status

    async def reload(**server_keys: object) -> int:
        data["server"].update(server_keys)
        path.write_text(yaml.safe_dump(data))
        async with http.post(url + "/admin/reload", headers=admin) as r:
            return r.status

    assert await status("/metrics") == 200
    assert await reload(allowed_hosts=["proxy.example"], metrics_api_keys=["mk"]) == 200
    assert await status("/v1/models") == 421
    assert await status("/metrics", Host="proxy.example") == 401
    assert await status("/metrics", Host="proxy.example", Authorization="Bearer mk") == 200
    # A bad entry rejects the whole file: the running keys stay.
    assert await reload(allowed_hosts=["http://proxy.example"], metrics_api_keys=[]) == 400
    assert await status("/metrics", Host="proxy.example") == 401
    assert await status("/v1/models") == 421
