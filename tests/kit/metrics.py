"""One Prometheus scrape, parsed by ``prometheus_client.parser``."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

import aiohttp
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from vllm_proxy.engines.instance import Instance

if TYPE_CHECKING:
    from kit.harness import RunningProxy


@dataclass(frozen=True)
class Samples:
    """Every sample of one scrape."""

    samples: tuple[Sample, ...]

    def find(self, name: str, **labels: str) -> list[Sample]:
        """The samples named `name` whose labels include `labels`."""
        return [
            s
            for s in self.samples
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
        ]

    def get(self, name: str, **labels: str) -> float | None:
        """The sum of `find(name, **labels)`, or None when there is none."""
        found = self.find(name, **labels)
        return sum(s.value for s in found) if found else None

    def value(self, name: str, **labels: str) -> float:
        """The sum of `find(name, **labels)`; 0 when there is none."""
        return self.get(name, **labels) or 0.0

    def at(self, key: str) -> float | None:
        """One series written as in the exposition, ``name{label="value",...}`` (every label),
        or None when there is none."""
        name, _, rest = key.partition("{")
        labels = dict(re.findall(r'(\w+)="([^"]*)"', rest))
        found = [s.value for s in self.samples if s.name == name and s.labels == labels]
        return found[0] if found else None

    def names(self) -> set[str]:
        return {s.name for s in self.samples}


def scrape(text: str) -> Samples:
    """A Prometheus text exposition, parsed."""
    families = text_string_to_metric_families(text)
    return Samples(tuple(s for family in families for s in family.samples))


async def fetch(session: aiohttp.ClientSession, url: str) -> Samples:
    """``GET url`` (a /metrics page), parsed."""
    async with session.get(url) as resp:
        assert resp.status == 200, f"{url}: {resp.status}"
        return scrape(await resp.text())


async def proxy_samples(proxy: RunningProxy) -> Samples:
    """The proxy's own ``/metrics``."""
    return await fetch(proxy.http, proxy.url + "/metrics")


async def engine_samples(proxy: RunningProxy, inst: Instance) -> Samples:
    """The ``/metrics`` of the instance's engine (the fake engine's counters among them)."""
    assert inst.engine is not None
    async with inst.engine.client(proxy.http).get(inst.engine.base_url + "/metrics") as resp:
        return scrape(await resp.text())


async def proxy_metric(proxy: RunningProxy, name: str, **labels: str) -> float | None:
    """One series of the proxy's ``/metrics`` (summed over labels not given); None if absent."""
    return (await proxy_samples(proxy)).get(name, **labels)


async def engine_metric(proxy: RunningProxy, inst: Instance, name: str, **labels: str) -> float:
    """One series of the instance's engine's ``/metrics``, summed over labels not given."""
    return (await engine_samples(proxy, inst)).value(name, **labels)
