"""The gateway: an OpenAI-compatible HTTP API (FastAPI + uvicorn) in front of the hybrid runtime.

Endpoints: POST /v1/chat/completions and /v1/completions (JSON, or SSE with
`stream: true`), GET /v1/models, /health, /metrics (Prometheus), /openapi.json,
WebSocket /v1/stream (edge_runtime/server/ws_stream.py) and the chat page at /.

Which source produced which part travels in extension fields that standard
clients ignore: every streamed chunk carries `x_source` (local | cloud | cache), a
hand-off arrives as a chunk with an empty delta and `x_handoff`, and a whole
response carries `x_hybrid` (route, reason, hand-offs, usage per source, and
the text as segments by source).

Errors use OpenAI's format. 400 for invalid parameters (never a 422), 401 for a
missing or wrong key, 404 for an unknown model, 400 `context_length_exceeded`,
429 with Retry-After when more than `max_in_flight` requests are in flight,
503 when the answer cannot be produced (the device failed and no cloud). A
client that disconnects cancels its generation.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from edge_runtime.engine import sampling_defaults
from edge_runtime.server.schemas import APIError, ChatCompletionRequest, CompletionRequest, ErrorResponse, to_generation_request

STATIC = os.path.join(os.path.dirname(__file__), "static")
STATIC_TYPES = {".js": "text/javascript", ".css": "text/css"}
# The page runs only its own files' scripts: model output that became markup could run nothing.
PAGE_HEADERS = {"Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                                           "connect-src 'self'; object-src 'none'; base-uri 'none'; "
                                           "frame-ancestors 'none'; form-action 'self'",
                "X-Content-Type-Options": "nosniff", "Cache-Control": "no-cache"}
# What /openapi.json publishes: the errors as they are sent ("4XX" also stops FastAPI documenting a 422 that
# never comes) and, for generation, the SSE answer to `stream: true`.
V1_ERRORS = {"4XX": {"model": ErrorResponse, "description": "400 invalid, 401 key, 404 model, 429 busy"}}
GENERATION_RESPONSES = {**V1_ERRORS, 200: {"content": {"text/event-stream": {}}},
                        503: {"model": ErrorResponse, "description": "the answer could not be produced"}}


class Gateway:
    def __init__(self, runtime, model_id: str, api_key: str | None = None, max_in_flight: int = 8,
                 default_max_tokens: int = 256):
        keys = [api_key] if isinstance(api_key, str) else list(api_key or [])
        self.runtime, self.model_id, self.api_keys = runtime, model_id, tuple(k for k in keys if k)
        self.max_in_flight, self.default_max_tokens = max_in_flight, default_max_tokens
        # what a request that sets no sampling gets: the local model's recommendation, else llama.cpp's
        self.sampling = getattr(getattr(runtime, "local", None), "sampling_defaults", None) or sampling_defaults.NONE
        self.in_flight = 0
        self.counters = {"requests": 0, "errors": 0, "busy": 0, "cancelled": 0, "handoffs": 0,
                         "tokens_local": 0, "tokens_cloud": 0}
        self.started = time.time()

    # --- checks -------------------------------------------------------------------------------------
    def tenant(self, key: str | None) -> str | None:
        """Whose request this is: "local" when the server has no keys, else the key's tenant (a hash of the
        key: what the response cache scopes by); None for a missing or wrong key."""
        if not self.api_keys:
            return "local"
        found = None
        for k in self.api_keys:  # every key compared, in constant time each
            if key and hmac.compare_digest(key.encode(), k.encode()):
                found = "key-" + hashlib.sha256(k.encode()).hexdigest()[:16]
        return found

    def authorize(self, header: str | None) -> str:
        """The request's tenant; a 401 for a missing or wrong key."""
        tenant = self.tenant((header or "").removeprefix("Bearer ").strip())
        if tenant is None:
            raise APIError(401, "missing or wrong API key (send 'Authorization: Bearer <key>')",
                           type="authentication_error", code="invalid_api_key")
        return tenant

    def check_model(self, model: str) -> None:
        if model not in (self.model_id, "default"):
            raise APIError(404, f"the model '{model}' does not exist; this server serves '{self.model_id}'",
                           param="model", code="model_not_found")

    def check_context(self, gen) -> None:
        rt = self.runtime
        local_only = gen.local_only or rt.offline or rt.cloud is None or gen.route == "local"
        n_ctx = getattr(rt.local, "n_ctx", None)
        tokens = rt.prompt_tokens(gen)
        if local_only and n_ctx is not None and tokens is not None and tokens >= n_ctx:
            raise APIError(400, f"this model's context is {n_ctx} tokens but the prompt is {tokens} tokens "
                                f"(at least one must be left to generate)",
                           param="messages" if gen.messages is not None else "prompt",
                           code="context_length_exceeded")
        max_tokens = gen.params.max_tokens
        if local_only and n_ctx is not None and tokens is not None and tokens + max_tokens > n_ctx:
            raise APIError(400, f"this model's context is {n_ctx} tokens: the prompt ({tokens} tokens) plus "
                                f"max_tokens ({max_tokens}) do not fit; lower max_tokens to {n_ctx - tokens} "
                                f"or less", param="max_tokens", code="context_length_exceeded")

    def admit(self) -> None:
        if self.in_flight >= self.max_in_flight:
            self.counters["busy"] += 1
            raise APIError(429, f"the server is at its limit of {self.max_in_flight} requests in flight; retry "
                                f"shortly", type="rate_limit_error", code="busy", headers={"Retry-After": "1"})

    # --- generation ---------------------------------------------------------------------------------
    async def run(self, gen):
        """The runtime's events; the caller must close it. In-flight accounting is released on close."""
        self.in_flight += 1
        self.counters["requests"] += 1
        try:
            async for ev in self.runtime.stream(gen):
                if ev.type == "delta":
                    self.counters["tokens_" + ev.source] = self.counters.get("tokens_" + ev.source, 0) + len(ev.token_ids)
                elif ev.type == "handoff":
                    self.counters["handoffs"] += 1
                elif ev.type == "error":
                    self.counters["errors"] += 1
                yield ev
        finally:
            self.in_flight -= 1

    def metrics(self) -> str:
        lines = []
        for name, help_, value in [
            ("edge_gateway_requests_total", "Generation requests started.", self.counters["requests"]),
            ("edge_gateway_errors_total", "Generations that ended with an error.", self.counters["errors"]),
            ("edge_gateway_busy_total", "Requests refused with 429 (too many in flight).", self.counters["busy"]),
            ("edge_gateway_cancelled_total", "Generations cancelled by a client disconnect.",
             self.counters["cancelled"]),
            ("edge_gateway_handoffs_total", "Hand-offs between device and cloud.", self.counters["handoffs"]),
        ]:
            lines += [f"# HELP {name} {help_}", f"# TYPE {name} counter", f"{name} {value}"]
        lines += ["# HELP edge_gateway_tokens_total Completion tokens by source.", "# TYPE edge_gateway_tokens_total counter"]
        for src in ("local", "cloud"):
            lines.append(f'edge_gateway_tokens_total{{source="{src}"}} {self.counters.get("tokens_" + src, 0)}')
        lines += ["# HELP edge_gateway_in_flight Requests being generated.", "# TYPE edge_gateway_in_flight gauge",
                  f"edge_gateway_in_flight {self.in_flight}"]
        if getattr(self.runtime, "cache", None) is not None:
            lines += self.runtime.cache.metrics()
        return "\n".join(lines) + "\n"


def _error_response(e: APIError) -> Response:
    # NOTE: ASCII-escaped, as the SSE chunks are: a message that quotes the client (a model name holding a lone
    # surrogate, valid in JSON) cannot be encoded as UTF-8, and JSONResponse would turn that into a 500.
    return Response(json.dumps(e.body()), status_code=e.status, headers=e.headers, media_type="application/json")


def _stream_error(ev) -> APIError:
    code = ev.info.get("code") if ev.info else None
    if code in ("context_length", "context_length_exceeded"):
        return APIError(400, ev.error or "the prompt does not fit", code="context_length_exceeded")
    if code == "busy":
        return APIError(503, ev.error or "busy", type="server_error", code="busy", headers={"Retry-After": "1"})
    if code in ("invalid_request", "invalid_argument"):
        return APIError(400, ev.error or "invalid request", code=code)
    return APIError(503, ev.error or "the answer could not be produced", type="server_error", code=code or "unavailable")


class _Auth:
    """The API key check on /v1/ before body validation (no key, no details), as plain ASGI: a streamed
    answer's chunks go straight to the server, not through a per-chunk relay (starlette's
    BaseHTTPMiddleware), which cost about a third of the event loop's time per token under load."""

    def __init__(self, app, gateway: Gateway):
        self.app, self.gw = app, gateway

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            headers = dict(scope.get("headers") or [])
            auth = headers.get(b"authorization")
            try:
                self.gw.authorize(auth.decode("latin-1") if auth is not None else None)
            except APIError as e:
                return await _error_response(e)(scope, receive, send)
        await self.app(scope, receive, send)


def create_app(gateway: Gateway, resume_grace_s: float = 30.0) -> FastAPI:
    app = FastAPI(title="edge-runtime gateway", version="1", description=__doc__.split("\n\n")[0])
    app.state.gateway = gateway
    gw = gateway

    app.add_middleware(_Auth, gateway=gw)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return _error_response(e)

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, e: HTTPException):  # unknown route, wrong method, unparsable body
        return _error_response(APIError(e.status_code, str(e.detail), code="not_found" if e.status_code == 404
                                        else None, headers=dict(e.headers or {})))

    @app.exception_handler(Exception)
    async def _bug(request: Request, e: Exception):  # still a 500 (and a logged traceback), but in OpenAI's format
        return _error_response(APIError(500, "internal error", type="server_error", code="internal"))

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, e: RequestValidationError):
        err = e.errors()[0] if e.errors() else {}
        if err.get("type") == "json_invalid":  # its loc holds a character offset, not a parameter
            why = err.get("ctx", {}).get("error", "decode error")
            return _error_response(APIError(400, f"the body is not valid JSON (at character {err['loc'][-1]}): {why}",
                                            code="invalid_value"))
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        param = ".".join(loc) or None
        msg = f"invalid '{param}': {err.get('msg', 'invalid value')}" if param else f"invalid body: {err.get('msg')}"
        return _error_response(APIError(400, msg, param=param, code="invalid_value"))

    @app.get("/health")
    async def health():
        rt = gw.runtime
        cloud = None
        if rt.cloud is not None and not rt.offline:
            h = getattr(rt.cloud, "health", None)
            cloud = {"state": h.state if h else "unknown", "detail": h.describe() if h else ""}
        return {"status": "ok", "model": gw.model_id, "offline": rt.offline, "cloud": cloud,
                "in_flight": gw.in_flight, "uptime_s": round(time.time() - gw.started, 1),
                "sampling_defaults": gw.sampling.as_dict(),
                "local_engine": rt.local.engine.stats() if hasattr(rt.local, "engine") else None,
                "cache": rt.cache.stats() if getattr(rt, "cache", None) is not None else None}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics():
        return PlainTextResponse(gw.metrics(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models", responses=V1_ERRORS)
    async def models():
        return {"object": "list", "data": [{"id": gw.model_id, "object": "model", "created": int(gw.started),
                                            "owned_by": "edge-runtime"}]}

    @app.get("/", response_class=HTMLResponse)
    async def page():
        path = os.path.join(STATIC, "index.html")
        if not os.path.exists(path):
            return HTMLResponse("<p>edge-runtime gateway: the API is at /v1</p>")
        with open(path, encoding="utf-8") as f:
            return HTMLResponse(f.read(), headers=PAGE_HEADERS)

    @app.get("/static/{name}", include_in_schema=False)
    async def static(name: str):
        kind = STATIC_TYPES.get(os.path.splitext(name)[1])
        if kind is None or name not in os.listdir(STATIC):
            raise HTTPException(404, f"no file {name!r} in the page's folder")
        with open(os.path.join(STATIC, name), encoding="utf-8") as f:
            return Response(f.read(), media_type=kind, headers=PAGE_HEADERS)

    @app.post("/v1/chat/completions", responses=GENERATION_RESPONSES)
    async def chat(body: ChatCompletionRequest, request: Request):
        return await _complete(request, body, chat=True)

    @app.post("/v1/completions", responses=GENERATION_RESPONSES)
    async def completions(body: CompletionRequest, request: Request):
        return await _complete(request, body, chat=False)

    async def _complete(request: Request, body, chat: bool):
        gw.check_model(body.model)
        gen = to_generation_request(body, gw.default_max_tokens, gw.sampling)
        gen.tenant = gw.authorize(request.headers.get("authorization"))
        gw.check_context(gen)
        gw.admit()
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        events = gw.run(gen)
        first = []  # events up to the first delta: an early error is still an HTTP error
        try:
            async for ev in events:
                first.append(ev)
                if ev.type == "error":
                    raise _stream_error(ev)
                if ev.type in ("delta", "finish"):
                    break
        except BaseException:
            await events.aclose()
            raise
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(_sse(gw, events, first, rid, created, chat, include_usage),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        return await _whole(events, first, rid, created, chat)

    async def _whole(events, first, rid, created, chat):
        segments, info, finish, usage = [], {}, "stop", None
        try:
            async for ev in _chain(first, events):
                if ev.type == "delta" and ev.text:
                    if segments and segments[-1]["source"] == ev.source:
                        segments[-1]["text"] += ev.text
                    else:
                        segments.append({"source": ev.source, "text": ev.text})
                elif ev.type == "start":
                    info = {"route": ev.info.get("route"), "route_reason": ev.info.get("route_reason")}
                elif ev.type == "finish":
                    finish, usage = ev.finish_reason, ev.usage
                    info.update(handoffs=ev.info.get("handoffs", []), usage_by_source=ev.info.get("usage_by_source"))
                elif ev.type == "error":
                    raise _stream_error(ev)
        finally:
            await events.aclose()
        text = "".join(s["text"] for s in segments)
        choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish,
                   "logprobs": None} if chat else {"index": 0, "text": text, "finish_reason": finish, "logprobs": None})
        return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
                "model": gw.model_id, "choices": [choice],
                "usage": {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
                          "total_tokens": usage.prompt_tokens + usage.completion_tokens},
                "x_hybrid": {**info, "segments": segments}}

    from edge_runtime.server.ws_stream import mount_ws

    mount_ws(app, gw, grace_s=resume_grace_s)
    return app


async def _chain(first, rest):
    for ev in first:
        yield ev
    async for ev in rest:
        yield ev


async def _sse(gw: Gateway, events, first, rid, created, chat, include_usage):
    obj = "chat.completion.chunk" if chat else "text_completion"

    def chunk(choice: dict | None, **extra) -> str:
        body = {"id": rid, "object": obj, "created": created, "model": gw.model_id,
                "choices": [choice] if choice is not None else [], **extra}
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    def choice(text: str | None = None, finish=None, role=False) -> dict:
        if chat:
            delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text is not None else {})
            return {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
        return {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}

    finished = False  # neither finished nor failed: the client left
    try:
        async for ev in _chain(first, events):
            if ev.type == "start":
                extra = {"x_route": ev.info.get("route"), "x_route_reason": ev.info.get("route_reason")}
                yield chunk(choice(role=True) if chat else choice(""), **extra)
            elif ev.type == "delta":
                yield chunk(choice(ev.text), x_source=ev.source)
            elif ev.type == "handoff":
                h = {k: ev.info.get(k) for k in ("from", "to", "at_char", "reason", "token_ids")}
                yield chunk(choice(None if chat else ""), x_handoff=h, x_source=ev.source)
            elif ev.type == "finish":
                finished = True
                yield chunk(choice(None if chat else "", finish=ev.finish_reason), x_source=ev.source,
                            x_usage_by_source=ev.info.get("usage_by_source"))
                if include_usage:
                    u = ev.usage
                    yield chunk(None, usage={"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
                                             "total_tokens": u.prompt_tokens + u.completion_tokens})
            elif ev.type == "error":
                finished = True
                yield f"data: {json.dumps(_stream_error(ev).body())}\n\n"
                break
        yield "data: [DONE]\n\n"
    finally:
        if not finished:
            gw.counters["cancelled"] += 1
        await events.aclose()
