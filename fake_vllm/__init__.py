"""A fake vLLM OpenAI-compatible server for component tests, benchmarks and the no-GPU demo.

Run it the way the proxy runs vLLM::

    python -m fake_vllm --model m --served-model-name m alias --port 8001

Understood flags: ``--model`` (default ``fake-model``), ``--served-model-name A [B ...]``
(first name is the response ``model``; any listed name is accepted), ``--host`` (default
127.0.0.1), ``--port`` (default 8000), ``--max-model-len`` (default 2048; ``4k``/``4K``/``auto``
accepted), ``--max-num-seqs`` (default 256; more concurrent requests queue as "waiting"),
``--tensor-parallel-size``/``-tp`` (entries in ``/collective_rpc`` results) and ``--api-key``
(also ``VLLM_API_KEY``; guards ``/v1*`` with 401 ``{"error":"Unauthorized"}``). Flags may be
spelled with ``_`` or ``-``; every other flag is accepted and ignored.

It mimics the newest vLLM server: the port is bound only when the "engine" is ready (connections
are refused before), ``Errno 98`` and exit 1 when the port is taken, nested OpenAI error bodies,
``{"detail": ...}`` for unknown routes, vLLM's exact JSON and SSE shapes, Prometheus ``/metrics``
with ``vllm:*`` series, dev-mode sleep endpoints (``VLLM_SERVER_DEV_MODE=1``) that park requests
until ``/wake_up``, and SIGTERM/SIGINT aborting in-flight requests (``finish_reason: "abort"``)
before exiting 0. Replies are the words ``tok0 tok1 ...``; prompt tokens are counted as words.
``/v1/embeddings`` returns deterministic unit vectors of dimension 8. Nothing is logged per request.
``/sleep`` takes ``level`` (0-2) and ``mode`` (``abort``: in-flight requests end with ``abort``;
``wait``: drain first; ``keep``: freeze them until woken). As in vLLM, requests parked by sleep do
not show in ``vllm:num_requests_waiting``; requests queued beyond ``--max-num-seqs`` do.

Knobs (environment variables):

``FAKE_ENGINE_STARTUP_DELAY``
    Seconds of "model loading" before the port is bound (default 0).
``FAKE_ENGINE_TOKENS``
    Tokens per reply (default 8); a reply has ``min(max_tokens, FAKE_ENGINE_TOKENS)`` tokens and
    finishes with ``length`` when ``max_tokens`` (or the context) was the limit, else ``stop``.
``FAKE_ENGINE_TOKEN_DELAY``
    Seconds per generated token (default 0); the first token also waits one delay.
``FAKE_ENGINE_CRASH_AFTER``
    N: after N chat/completion requests, the next one kills the process with
    ``os._exit(FAKE_ENGINE_CRASH_CODE)``; a stream first sends a couple of chunks.
``FAKE_ENGINE_CRASH_CODE``
    Exit status of that crash (default 3).
``FAKE_ENGINE_EXIT_CODE``
    Fail start-up: after the startup delay, print
    ``RuntimeError: Engine core initialization failed (fake) ...`` and exit with this status
    without ever binding the port.
``FAKE_ENGINE_IGNORE_SIGTERM``
    ``1``: SIGTERM is ignored from the very start (SIGINT still stops the server).
``FAKE_ENGINE_SPAWN_CHILD``
    ``1``: fork an ``EngineCore`` child (same process group, title ``VLLM::EngineCore`` when it
    can be set, SIGTERM ignored, sleeps forever) and print ``EngineCore pid=<pid>``. It is left
    behind on a clean shutdown, like vLLM's orphaned engine: only a process-group kill ends it.
``FAKE_ENGINE_PORT_IN_USE_ONCE``
    A file path: if the file does not exist, create it and fail like a taken port when binding
    (after the startup delay; ``Errno 98``, exit 1); later starts with that path run normally.
``FAKE_ENGINE_SLEEP_DELAY`` / ``FAKE_ENGINE_WAKE_DELAY``
    Seconds ``/sleep`` and ``/wake_up`` take (default 0).
``VLLM_SERVER_DEV_MODE``
    ``1``: register ``/sleep``, ``/wake_up``, ``/is_sleeping``, ``/collective_rpc`` and
    ``/reset_prefix_cache`` (404 ``{"detail":"Not Found"}`` otherwise).
"""

from .process import main

__all__ = ["main"]
