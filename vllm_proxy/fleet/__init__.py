"""`vllm-proxy-fleet`: places every model of a fleet of proxies on one server, in HAProxy's map.

A tool beside the proxy, not part of it: it reads each proxy's ``/placement`` over HTTP and
imports only the package's shared modules (tests/package/test_imports.py).
"""
