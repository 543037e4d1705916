"""What each URL is: the routes that name a model, the uploads, and which paths a browser
page of any site could reach.

* `MODEL_ROUTES`: the JSON POST routes routed by the body's ``model``;
* `UPLOAD_ROUTES`: the form uploads routed by their ``model`` field;
* `PREFIXED_TAILS`: what ``/serve/{model}/v1/{tail}`` may reach (`UPLOAD_TAILS` of them uploads);
* `guarded(path)`: the OpenAI routes, under API keys and in the access log;
* `opens_to_pages(path)`: the paths a page of another site could reach without a CORS preflight.
"""

from __future__ import annotations

from ..realtime_relay import PATH as REALTIME_PATH

#: POST endpoints routed to an engine by the body's ``model``: every JSON route of vLLM that
#: names one (docs/design.md, "Routes that name a model").
MODEL_ROUTES = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/embeddings",
    "/v1/responses",
    "/v1/score",
    "/v1/rerank",
    "/tokenize",
    "/detokenize",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/v1/chat/completions/batch",
    "/v2/embed",
    "/pooling",
    "/classify",
    "/score",
    "/rerank",
    "/v2/rerank",
    "/generative_scoring",
    "/v1/decisions",
    "/v1/systemone",
    "/cohere/v2/chat",
    "/invocations",
    # vLLM's scale-out routes (``--enable-scale-out``, ``--tokens-only``)
    "/v1/chat/completions/render",
    "/v1/completions/render",
    "/v1/messages/render",
    "/v1/responses/render",
    "/cohere/v2/chat/render",
    "/v1/chat/completions/derender",
    "/v1/completions/derender",
    "/inference/v1/generate",
)
#: POST endpoints whose body is a form upload, routed by its ``model`` field (`bytes.upload`).
UPLOAD_ROUTES = ("/v1/audio/transcriptions", "/v1/audio/translations")

#: The ``/v1/...`` routes a ``/serve/{model}/v1/{tail}`` path may reach.
PREFIXED_TAILS = frozenset(
    r.removeprefix("/v1/") for r in (*MODEL_ROUTES, *UPLOAD_ROUTES) if r.startswith("/v1/")
)
UPLOAD_TAILS = frozenset(r.removeprefix("/v1/") for r in UPLOAD_ROUTES)

#: The model routes outside ``/v1/``.
_ROOT_ROUTES = frozenset(r for r in MODEL_ROUTES if not r.startswith("/v1/"))
#: Routes a page of any site could reach without a CORS preflight and be served (`opens_to_pages`).
_PAGE_ROUTES = frozenset((*UPLOAD_ROUTES, REALTIME_PATH))
_PAGE_TAILS = tuple(r.removeprefix("/v1") for r in _PAGE_ROUTES)


def guarded(path: str) -> bool:
    """Whether `path` is one of the OpenAI routes: under API keys, in the access log and the
    ring of recent requests."""
    return path.startswith(("/v1/", "/serve/")) or path in _ROOT_ROUTES


def opens_to_pages(path: str) -> bool:
    """Whether a browser page of any site could make a request to `path` without a CORS
    preflight, and be served: a form upload or a WebSocket (the JSON routes refuse the types
    a page may send without one: `bytes.intake.check_type`)."""
    return path in _PAGE_ROUTES or (path.startswith("/serve/") and path.endswith(_PAGE_TAILS))
