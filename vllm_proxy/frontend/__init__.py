"""The request path: from a client's connection to an engine's answer.

Connection handling, keys, body scanning and intake, forms and uploads, the realtime relay, the
upstream client to engines, and the HTTP handlers (`proxy.Proxy` for clients, `admin` for
operators). It reads the pool and the engines; nothing below imports it.
"""
