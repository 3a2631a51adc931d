"""WebSocket `/v1/stream`: the hybrid runtime's events for pages and apps, with resume after a reconnect.

Client frames (JSON text): `hello` {api_key} first when the server has a key;
`generate` {id, messages | prompt, params, route, local_only, cache}; `cancel` {id};
`resume` {id, after} on a new connection. Server frames: `welcome` {model, resume_grace_s},
then per stream `start` {route, route_reason, source, prompt_tokens, and `cache` {kind, score} on a cache
hit}, `delta` {seq, text, token_ids,
source}, `handoff` {from, to, at_char, reason}, `finish` {finish_reason,
usage, usage_by_source, handoffs} or `error` {code, message}. Every stream
frame has `id` and `n`, its number in that stream (0, 1, 2, ...).

A stream keeps generating when its connection drops; its frames are kept for
`grace_s` seconds, and `resume` with the last `n` received replays the rest
and goes on, so nothing is lost or repeated. After the grace period, or on
`cancel`, the generation stops.
"""
from __future__ import annotations

import asyncio
import hmac
import json
from dataclasses import asdict, dataclass, field

from starlette.websockets import WebSocket, WebSocketDisconnect

from edge_runtime.errors import EdgeRuntimeError
from edge_runtime.request import GenerationRequest

AUTH_CLOSE = 4401
MAX_STREAMS_PER_CONNECTION = 8


@dataclass
class _Stream:
    id: str
    frames: list = field(default_factory=list)
    conn: "_Conn | None" = None
    task: asyncio.Task | None = None
    done: bool = False
    expiry: asyncio.TimerHandle | None = None


class _Conn:
    def __init__(self, ws: WebSocket):
        self.ws, self.queue = ws, asyncio.Queue()
        self.tenant = "local"  # the API key's tenant once `hello` names it

    async def writer(self) -> None:
        while True:
            frame = await self.queue.get()
            if frame is None:
                return
            await self.ws.send_text(json.dumps(frame, ensure_ascii=False))


def _frame(sid: str, n: int, ev) -> dict:
    f = {"type": ev.type, "id": sid, "n": n}
    if ev.type == "start":
        f.update(route=ev.info.get("route"), route_reason=ev.info.get("route_reason"), source=ev.source,
                 prompt_tokens=ev.info.get("prompt_tokens"))
        if "cache" in ev.info:
            f["cache"] = {k: ev.info["cache"][k] for k in ("kind", "score")}
    elif ev.type == "delta":
        f.update(seq=ev.seq, text=ev.text, token_ids=list(ev.token_ids), source=ev.source)
    elif ev.type == "handoff":
        f.update({k: ev.info.get(k) for k in ("from", "to", "at_char", "reason", "token_ids")})
    elif ev.type == "finish":
        f.update(finish_reason=ev.finish_reason, usage=asdict(ev.usage) if ev.usage else None,
                 usage_by_source=ev.info.get("usage_by_source"), handoffs=ev.info.get("handoffs"), source=ev.source)
    else:
        f.update(code=(ev.info or {}).get("code", "error"), message=ev.error)
    return f


def _cut_short(s: _Stream) -> dict:
    """The `finish` frame of a stream ended by `cancel` or by its grace period, with the fields of a natural
    finish counted from the frames it sent: completion tokens per source (a cloud delta without ids counts as
    one token, as the runtime counts it), the prompt for the first source, and for a source reached by a
    hand-off the prompt plus the answer so far (what it had to read)."""
    prompt = start_source = None
    by_source: dict = {}
    handoffs, generated, source = [], 0, None
    for f in s.frames:
        if f["type"] == "start":
            prompt, start_source = f.get("prompt_tokens") or 0, f.get("source")
            source = start_source
        elif f["type"] == "delta":
            source = f["source"]
            used = len(f["token_ids"]) or int(source == "cloud" and bool(f["text"]))
            u = by_source.setdefault(source, {"prompt_tokens": (prompt or 0) + (generated if source != start_source
                                                                                 else 0), "completion_tokens": 0})
            u["completion_tokens"] += used
            generated += used
        elif f["type"] == "handoff":
            handoffs.append({k: f.get(k) for k in ("from", "to", "at_char", "reason", "token_ids")})
            source = f.get("to")
    return {"type": "finish", "id": s.id, "n": len(s.frames), "finish_reason": "cancelled",
            "usage": {"prompt_tokens": prompt or 0, "completion_tokens": generated}, "usage_by_source": by_source,
            "handoffs": handoffs, "source": source}


def mount_ws(app, gw, grace_s: float = 30.0) -> None:
    streams: dict[str, _Stream] = {}
    app.state.ws_streams = streams

    def push(s: _Stream, frame: dict) -> None:
        s.frames.append(frame)
        if s.conn is not None:
            s.conn.queue.put_nowait(frame)

    async def produce(s: _Stream, gen: GenerationRequest) -> None:
        events = gw.run(gen)
        try:
            async for ev in events:
                push(s, _frame(s.id, len(s.frames), ev))
        except asyncio.CancelledError:
            push(s, _cut_short(s))
        finally:
            s.done = True
            await events.aclose()
            if s.conn is None:
                _expire_later(s)

    def _expire_later(s: _Stream) -> None:
        if s.expiry is not None:
            s.expiry.cancel()

        def expire() -> None:
            if s.conn is None:
                if s.task is not None and not s.done:
                    s.task.cancel()
                streams.pop(s.id, None)
        s.expiry = asyncio.get_running_loop().call_later(grace_s, expire)

    def error(conn: _Conn, sid, code: str, message: str) -> None:
        conn.queue.put_nowait({"type": "error", "id": sid, "code": code, "message": message})

    def start(conn: _Conn, msg: dict) -> None:
        sid = msg.get("id")
        if not isinstance(sid, str) or not 0 < len(sid) <= 128:
            return error(conn, None, "bad_frame", "'id' must be a string of 1 to 128 characters")
        if sid in streams and not streams[sid].done:
            return error(conn, sid, "duplicate_id", f"stream {sid!r} is already running")
        if sum(1 for s in streams.values() if s.conn is conn and not s.done) >= MAX_STREAMS_PER_CONNECTION:
            return error(conn, sid, "busy", f"at most {MAX_STREAMS_PER_CONNECTION} streams per connection")
        params = msg.get("params") or {}
        if not isinstance(params, dict):
            return error(conn, sid, "invalid_request", "'params' must be an object")
        try:
            gen = GenerationRequest(messages=msg.get("messages"), prompt=msg.get("prompt"),
                                    params=gw.sampling.params(**{"max_tokens": gw.default_max_tokens, **params}),
                                    route=msg.get("route", "auto"), local_only=bool(msg.get("local_only", False)),
                                    cache=msg.get("cache", "auto"), tenant=conn.tenant)
        except EdgeRuntimeError as e:
            return error(conn, sid, "invalid_request", e.message)
        except TypeError as e:
            return error(conn, sid, "invalid_request", f"unknown sampling parameter: {e}")
        if gw.in_flight >= gw.max_in_flight:
            return error(conn, sid, "busy", f"the server is at its limit of {gw.max_in_flight} requests in flight")
        s = _Stream(sid, conn=conn)
        streams[sid] = s
        s.task = asyncio.get_running_loop().create_task(produce(s, gen))

    def resume(conn: _Conn, msg: dict) -> None:
        sid, after = msg.get("id"), msg.get("after", -1)
        s = streams.get(sid)
        if s is None:
            return error(conn, sid, "unknown_stream", f"stream {sid!r} is not held (unknown, or its grace period "
                                                      f"of {grace_s:g} s is over)")
        if not isinstance(after, int) or after < -1:
            return error(conn, sid, "bad_frame", "'after' must be an integer >= -1")
        if s.expiry is not None:
            s.expiry.cancel()
            s.expiry = None
        s.conn = conn
        for f in s.frames[after + 1:]:
            conn.queue.put_nowait(f)

    @app.websocket("/v1/stream")
    async def ws_stream(ws: WebSocket):
        await ws.accept()
        conn = _Conn(ws)
        writer = asyncio.get_running_loop().create_task(conn.writer())
        try:
            first = True
            while True:
                try:
                    msg = json.loads(await ws.receive_text())
                    if not isinstance(msg, dict):
                        raise ValueError
                except (ValueError, KeyError):
                    error(conn, None, "bad_frame", "frames are JSON objects with a 'type'")
                    continue
                kind = msg.get("type")
                if first:
                    first = False
                    if gw.api_keys:
                        key = msg.get("api_key") if kind == "hello" else None
                        tenant = gw.tenant(key) if isinstance(key, str) else None
                        if tenant is None:
                            await ws.close(AUTH_CLOSE, "unauthorized: send hello with the API key first")
                            return
                        conn.tenant = tenant
                    if kind == "hello":
                        conn.queue.put_nowait({"type": "welcome", "model": gw.model_id, "resume_grace_s": grace_s})
                        continue
                if kind == "generate":
                    start(conn, msg)
                elif kind == "resume":
                    resume(conn, msg)
                elif kind == "cancel":
                    s = streams.get(msg.get("id"))
                    if s is None or s.done:
                        error(conn, msg.get("id"), "unknown_stream", f"no running stream {msg.get('id')!r}")
                    else:
                        s.task.cancel()
                elif kind == "hello":
                    error(conn, None, "bad_frame", "hello comes first, once")
                else:
                    error(conn, msg.get("id"), "unknown_type", f"unknown frame type {kind!r} (hello, generate, "
                                                               f"cancel, resume)")
        except WebSocketDisconnect:
            pass
        finally:
            for s in list(streams.values()):
                if s.conn is conn:
                    s.conn = None
                    _expire_later(s)
            conn.queue.put_nowait(None)
            writer.cancel()
