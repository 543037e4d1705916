"""The request path: from a client's connection to an engine's answer.

Three rooms, and what they share:

* `bytes`: the bytes from the client (its connection, bodies, forms, uploads);
* `upstream`, `relay`, `realtime_relay`: the client to engines and the relay of their answers;
* `routes`: what each URL does (the OpenAI routes, realtime, admin, console, catalogue, the
  placement page);
* `serving`: what every route shares (resolution within a key's scope, key limits, budgets,
  observation); `gate`: who may drive the proxy at all.

It reaches engines only through the pool (`pool.lease`, `pool.views`); nothing below imports it.
"""
