"""What each URL does: one module per family of routes.

* `openai`: the OpenAI-compatible routes, ``/serve/{model}/v1/...``, ``/v1/models``,
  ``/health``, ``/metrics``;
* `realtime`: vLLM's realtime WebSocket, a session held as a request that lasts;
* `admin`: the admin API, the status page and ``/metrics/engines``;
* `console`: the operator console under ``/admin``;
* `catalogue`: the cards ``/v1/models`` lists;
* `placement_page`: ``/placement`` and ``/metrics/model-server``, what this proxy holds, for
  whoever places models across servers (the fleet's own algorithm is `fleet.placement`).
"""
