"""A fake vLLM OpenAI-compatible server for component tests, benchmarks and the no-GPU demo.

Run it the way the proxy runs vLLM::

    python -m fake_vllm --model m --served-model-name m alias --port 8001

Understood flags: ``--model`` (default ``fake-model``), ``--served-model-name A [B ...]`` (first
name is the response ``model``; any listed name is accepted), ``--host`` (default 127.0.0.1),
``--port`` (default 8000), ``--uds PATH`` (serve on that Unix socket only, as vLLM does; a file
already at the path fails the start like a taken port), ``--max-model-len`` (default 2048;
``4k``/``4K``/``auto`` accepted), ``--max-num-seqs`` (default 256; more concurrent requests
queue as "waiting"), ``--tensor-parallel-size``/``-tp`` (entries in ``/collective_rpc``
results), ``--enable-sleep-mode`` (see sleep mode below) and ``--api-key`` (also
``VLLM_API_KEY``; guards ``/v1*`` with 401 ``{"error":"Unauthorized"}``). Simulated-GPU mode
also reads ``--pipeline-parallel-size``/``-pp``, ``--prefill-context-parallel-size``,
``--gpu-memory-utilization`` (default 0.9), ``--kv-cache-memory-bytes`` and
``--sleep-mode-offload-cudagraph``. ``--runner pooling`` or ``--convert embed|classify`` makes a
pooling model, without the completion routes (as vLLM registers them only for generating
models); when ``--pooler-config '{"task": ...}'`` or ``--convert`` names its task, only that
task's routes are served, as in vLLM: ``/classify`` for ``classify``, ``/v1/embeddings`` for
``embed`` and ``token_embed``, ``/pooling`` for all.
``--enable-lora``, ``--max-loras``, ``--max-lora-rank`` and ``--max-cpu-loras`` with
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`` serve LoRA adapters loaded at run time (see
``fake_vllm.lora``; knobs ``FAKE_ENGINE_LORA_FAIL=name,...`` and
``FAKE_ENGINE_LORA_LOAD_DELAY``). Flags may be spelled with ``_`` or ``-``; every other flag is
accepted and ignored.

It mimics the newest vLLM server: the port (or socket) is bound only when the "engine" is ready
(connections are refused before), ``Errno 98`` and exit 1 when the port is taken, nested OpenAI
error bodies, ``{"detail": ...}`` for unknown routes, vLLM's exact JSON and SSE shapes,
Prometheus ``/metrics`` with ``vllm:*`` series, dev-mode endpoints, and SIGTERM/SIGINT aborting
in-flight requests (``finish_reason: "abort"``) before exiting 0. Replies are the words
``tok0 tok1 ...``; prompt tokens are counted as words. ``/v1/embeddings`` returns deterministic
unit vectors of dimension 8. A completion asked for ``logprobs`` or ``return_token_ids`` gets
them (non-streamed; ``fake_vllm.tokens``): the same for the same request.
Nothing is logged per request. vLLM's other routes that name a
model (Anthropic ``/v1/messages``, the pooling, scoring and ``/v2/embed`` routes of a pooling
model, the speech-to-text uploads and the ``/v1/realtime`` WebSocket) are in
``fake_vllm.routes_extra`` (``FAKE_ENGINE_UPLOAD_LOG=PATH`` records each upload's bytes).

Sleep mode, as in vLLM 0.33: ``VLLM_SERVER_DEV_MODE=1`` registers ``/collective_rpc``,
``/reset_prefix_cache``, ``/sleep``, ``/wake_up`` and ``/is_sleeping``. Without the
``--enable-sleep-mode`` flag a sleep only pauses: it reports sleeping but frees nothing and loses
no weights (vLLM then has no CuMem pool to release). Missing routes answer 404
``{"detail":"Not Found"}``.

- ``POST /sleep?level=N`` (0-2, default 1; 400 otherwise) answers
  ``{"status":"sleeping","level":N}`` after ``FAKE_ENGINE_SLEEP_DELAY``. ``mode`` decides what
  happens to running requests: ``abort`` (default; they end with ``abort``), ``wait`` (drain
  first) or ``keep`` (frozen until woken). Level 1 offloads the weights and drops the KV cache,
  level 2 drops both, level 0 only pauses.
- ``POST /wake_up`` (optional repeated ``tags=weights|kv_cache``) answers after
  ``FAKE_ENGINE_WAKE_DELAY``: ``{"status":"awake","tags":null}``, or ``"sleeping"`` while a
  partial wake leaves a tag asleep. ``GET /is_sleeping`` is ``{"is_sleeping":true}`` from the
  start of ``/sleep`` until a wake has woken every tag (so also while a wake is under way).
- While asleep, chat, completion and embedding requests park until the wake, as vLLM 0.33
  queues them (and like vLLM they are left out of ``vllm:num_requests_waiting``);
  ``FAKE_ENGINE_ASLEEP=reject`` answers them 503
  ``{"error":{"message":"The engine is sleeping; wake it up with POST /wake_up first.",
  "type":"ServiceUnavailableError","param":null,"code":503}}`` instead. Either way each is
  counted.
  ``/health`` stays 200 and ``vllm:engine_sleep_state`` says ``awake``, ``weights_offloaded``
  (level 1) or ``discard_all`` (level 2).
- After a level-2 sleep the weights are lost: once awake, every chat/completion token is
  ``<garbage> `` until ``POST /collective_rpc {"method":"reload_weights"}`` (500 while the
  weights are still asleep). Embeddings are not affected. Other ``collective_rpc`` methods
  answer ``{"results":[null,...]}`` (one per ``-tp`` rank); ``POST /reset_prefix_cache`` answers
  ``{"success":true}``.
- Fake-only series on ``/metrics`` (labels ``engine="0",model_name=...`` like vLLM's):
  ``fake_engine:sleeps_total{level="0|1|2"}`` and ``fake_engine:wakes_total`` (calls answered
  200, partial and lying wakes included), ``fake_engine:reload_weights_total``,
  ``fake_engine:reset_prefix_cache_total``, ``fake_engine:requests_while_asleep_total``,
  ``fake_engine:garbage_completions_total`` (requests answered with ``<garbage>``),
  ``fake_engine:sleep_operations_in_flight{operation="sleep|wake"}`` and
  ``fake_engine:gpu_bytes`` (device memory held in GPU mode, else 0).
- Failed sleep/wake calls answer 500
  ``{"error":{"message":...,"type":"InternalServerError","param":null,"code":500}}``.

GPU mode (``FAKE_ENGINE_GPU_MB=N``) holds real device memory through torch, imported only then,
laid out and moved like vLLM 0.33's CuMem pools (``fake_vllm.gpu``): of the N MiB, 60 % are
"weights" in 34 tensors of a Llama's uneven sizes, 25 % "KV cache", 3 % the "runtime" pool and
12 % the activation peak. Before the port is bound the engine allocates the rest, and allocates
the peak once for "profiling", then frees it and empties torch's cache: a ready engine holds
N less the peak, and its first request takes the peak back (a request that cannot get it
answers 500). Level-1 sleep copies each weights tensor and the runtime pool into its own pinned
host tensor, level 2 only the runtime pool; both free everything on the device and empty torch's
cache (NVML sees the memory free). A wake empties the cache, reallocates the runtime pool and
the tags asked for, copies the backups back and drops them (torch's pinned host cache keeps
them), without the peak. After level 2 the weights are uninitialised until ``reload_weights``.
A wake that cannot get the memory back answers 500 and leaves the missing tags asleep. Without
torch or CUDA, or without the memory, start-up fails: a ``fake_vllm: error: FAKE_ENGINE_GPU_MB=N:
...`` line on stderr and exit 1.

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
    ``os._exit(FAKE_ENGINE_CRASH_CODE)``; a stream first sends a couple of chunks. Requests
    refused while asleep do not count.
``FAKE_ENGINE_STALL_AFTER``
    N: after N chat/completion requests, every later one stalls for good while ``/health``
    still answers 200 (a decode stall): a stream after its first couple of chunks, any other
    answer before its first byte. Requests refused while asleep do not count.
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
    Seconds ``/sleep`` and ``/wake_up`` take (default 0); the engine is asleep throughout both.
``FAKE_ENGINE_ASLEEP``
    ``park`` (default): requests that arrive while asleep wait for the wake; ``reject``: they
    get 503.
``FAKE_ENGINE_SLEEP_FAIL``
    ``1``: ``/sleep`` answers 500 (after the sleep delay) and the engine stays awake.
``FAKE_ENGINE_WAKE_FAIL``
    ``1``: ``/wake_up`` answers 500 (after the wake delay) and the engine stays asleep.
``FAKE_ENGINE_WAKE_HANG``
    ``1``: ``/wake_up`` never answers (503 at shutdown); the engine stays asleep.
``FAKE_ENGINE_WAKE_LIES``
    ``1``: ``/wake_up`` answers 200 ``awake`` but the engine stays asleep (``/is_sleeping``
    true, requests park).
``FAKE_ENGINE_WAKE_CORRUPTS``
    Sleep levels (``1``, ``2``, ``1,2`` or ``all``): once woken from one of them, every answer
    is wrong with HTTP 200 until the process ends: completions are ``<garbage>`` tokens with
    other ids and log-probabilities (and count as garbage completions), pooling answers other
    numbers.
Simulated-GPU mode (``FAKE_ENGINE_SIM_GPU=<ledger path>``, exclusive with GPU mode) holds memory
in a ``fake_vllm.simgpu.Ledger`` shared with other processes, following vLLM 0.33's rules (listed
in ``simgpu``'s docstring): the engine takes the first world-size devices of
``CUDA_VISIBLE_DEVICES`` (ledger indices; world size = ``-tp`` x ``-pp`` x
``--prefill-context-parallel-size``), creates a context outside the budget, checks that free
memory holds ``ceil(--gpu-memory-utilization x total)``, profiles weights, the runtime pool,
the transient peak and CUDA graphs over a window measured device-wide, releases the peak, and
fills the rest of the budget with KV cache (or ``--kv-cache-memory-bytes``). Failures print
vLLM's own error line to stderr and exit 1. The first request takes the peak back; when it
cannot, or after a sleep that failed with its memory unmapped, the engine dies like vLLM's
EngineCore: 500, a fatal-error log and exit 1. Sleep and wake move memory by CuMem allocation
(``--sleep-mode-offload-cudagraph`` pools the graphs) and pin offloaded ones at a power of two,
kept after the wake; ``reload_weights`` needs a transient allocation (freed at the
``kv_cache`` wake) and time, requests park while asleep, the memory is released at exit, and
``GET /sim/calls`` lists the sleep, wake and collective_rpc calls in arrival order with their
status. ``fake_vllm/simgpu_nvml/pynvml.py`` lets another
process read the same ledger through NVML calls.

``FAKE_ENGINE_GPU_MB``
    MiB of real GPU memory to hold (default 0: none); see GPU mode above.
``FAKE_ENGINE_GPU_DEVICE``
    The torch device for it (default ``cuda:0``, numbered within ``CUDA_VISIBLE_DEVICES``).
``FAKE_ENGINE_SIM_GPU``
    Path of a simulated-GPU ledger: turns on simulated-GPU mode (see above). Its sizes, in MiB
    per device: ``FAKE_ENGINE_SIM_CONTEXT_MB`` (512, CUDA context, outside the budget),
    ``FAKE_ENGINE_SIM_WEIGHTS_MB`` (1024) or ``FAKE_ENGINE_SIM_WEIGHT_SEGMENTS_MB`` (the
    weights' tensors, whole MiB, comma-separated, packed into torch's segments; default one of
    the weights' size), ``FAKE_ENGINE_SIM_VOCAB`` (0: none; the vocabulary of Model Runner V2's
    sampler state, ``--max-num-seqs`` x vocab int32 in the weights pool),
    ``FAKE_ENGINE_SIM_RUNTIME_MB`` (64, the CuMem ``runtime`` pool),
    ``FAKE_ENGINE_SIM_WORKSPACE_MB`` (0, the CuMem ``workspace`` pool, discarded by sleeps),
    ``FAKE_ENGINE_SIM_BUFFERS_MB`` (0, what a level-2 sleep copies to pageable host memory),
    ``FAKE_ENGINE_SIM_PEAK_MB`` (256, the transient peak, tag ``activation``; also read as
    ``FAKE_ENGINE_SIM_ACTIVATION_MB``), ``FAKE_ENGINE_SIM_GRAPHS_MB`` (256, tag ``cudagraph``,
    captured after the KV cache), ``FAKE_ENGINE_SIM_GRAPHS_ESTIMATE_MB`` (the profile's estimate
    of the graphs, taken from the KV cache; default ``FAKE_ENGINE_SIM_GRAPHS_MB``),
    ``FAKE_ENGINE_SIM_MIN_KV_MB`` (64, less KV fails the start), ``FAKE_ENGINE_SIM_RELOAD_TEMP_MB``
    (128, taken by ``reload_weights`` until the ``kv_cache`` wake); ``FAKE_ENGINE_SIM_PEAK_TOKENS``
    (0: the first request regrows the peak; N: the first time the running requests' prompt and
    reply tokens reach N); times: ``FAKE_ENGINE_SIM_PROFILE_S`` (0.3, the profiling window),
    ``FAKE_ENGINE_SIM_AFTER_PROFILE_S`` (0, from its end to ready: KV cache and graphs),
    ``FAKE_ENGINE_SIM_SLEEP_S`` (0.2, between the two free-memory readings of a sleep),
    ``FAKE_ENGINE_SIM_RELOAD_MB_S`` (4096, reload speed). With ``FAKE_ENGINE_SPAWN_CHILD=1``
    the memory is charged to the EngineCore child; it goes when the server exits, or when the
    child dies (a process-group kill).
``VLLM_SERVER_DEV_MODE``
    ``1``: register the dev-mode routes (see sleep mode above).
"""

from .process import main

__all__ = ["main"]
