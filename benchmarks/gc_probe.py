"""Run ``vllm-proxy`` with a garbage-collector probe (used by profile_proxy.py).

``python benchmarks/gc_probe.py --config X`` is ``vllm-proxy --config X`` plus a
``gc.callbacks`` hook that counts collections per generation and the time they take, printed at
exit as one ``GC_PROBE ...`` line on stderr. ``GC_PROBE_MODE`` may contain ``freeze``
(``gc.freeze()`` once the proxy's modules are imported) and/or ``threshold``
(``gc.set_threshold(50000, 20, 100)``) to try those settings without touching the proxy's code.
"""

from __future__ import annotations

import atexit
import gc
import os
import sys
import time

_count = [0, 0, 0]
_ms = [0.0, 0.0, 0.0]
_max = [0.0, 0.0, 0.0]
_t = [0.0]
_start = time.perf_counter()


def _cb(phase: str, info: dict[str, int]) -> None:
    if phase == "start":
        _t[0] = time.perf_counter()
        return
    ms = (time.perf_counter() - _t[0]) * 1e3
    g = info["generation"]
    _count[g] += 1
    _ms[g] += ms
    _max[g] = max(_max[g], ms)


def _report() -> None:
    wall = time.perf_counter() - _start
    print(
        f"GC_PROBE mode={os.environ.get('GC_PROBE_MODE') or 'default'} "
        f"collections(gen0,1,2)={_count} total_ms={[round(x) for x in _ms]} "
        f"max_ms={[round(x, 1) for x in _max]} gc_share_of_wall={sum(_ms) / 1e3 / wall:.1%}",
        file=sys.stderr,
        flush=True,
    )


def main() -> int:
    gc.callbacks.append(_cb)
    atexit.register(_report)
    mode = os.environ.get("GC_PROBE_MODE", "")
    import aiohttp  # noqa: F401
    import uvloop  # noqa: F401

    import vllm_proxy.app  # noqa: F401
    from vllm_proxy.cli import main as proxy_main

    if "freeze" in mode:
        gc.collect()
        gc.freeze()
    if "threshold" in mode:
        gc.set_threshold(50_000, 20, 100)
    return proxy_main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
