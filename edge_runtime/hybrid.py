"""The hybrid runtime: one ordered stream from the device and the cloud, with failover that loses no text.

`HybridRuntime.stream(request)` yields `start` (the route and why), `delta`
events numbered 0, 1, 2, ... across sources (each with `source` local or
cloud), a `handoff` event when the answer moves from one source to the other
(with the character offset where it happens), and one `finish` (reason and
usage per source) or `error`.

Failover: when the cloud stream ends with an error (the worker unreachable,
killed, stalled, or answering an error), the local backend continues the same
answer from the text the user has already seen (an assistant prefix), with the
tokens still allowed by max_tokens. The user's text is the concatenation of
the deltas: nothing repeats, nothing is skipped.

The cloud side is anything with `async stream(request, prefix)` yielding
StreamEvents (cloud_fallback.cloud_backend.CloudBackend); this module does not
import it. Routing today: the request's hint, privacy (`local_only`), offline
mode and whether a cloud is configured; the difficulty score and device state
come next.
"""
from __future__ import annotations

import contextlib
import copy
import time
from dataclasses import asdict, dataclass, field
from typing import AsyncIterator

from .request import GenerationRequest, GenerationResult, StreamEvent, Usage


@dataclass
class RouteDecision:
    route: str  # local | cloud
    reason: str


@dataclass
class _State:
    seq: int = 0
    text: str = ""
    ids: list[int] = field(default_factory=list)
    handoffs: list[dict] = field(default_factory=list)
    usage: dict = field(default_factory=dict)  # source -> Usage
    generated: int = 0  # completion tokens so far, all sources


class HybridRuntime:
    def __init__(self, local, cloud=None, offline: bool = False, route: str = "auto"):
        self.local, self.cloud, self.offline, self.route = local, cloud, offline, route

    def decide(self, request: GenerationRequest) -> RouteDecision:
        hint = request.route if request.route != "auto" else self.route
        if request.local_only:
            return RouteDecision("local", "local_only: the request must not leave the device")
        if self.offline:
            return RouteDecision("local", "offline mode: no network")
        if self.cloud is None:
            return RouteDecision("local", "no cloud worker configured")
        if hint == "cloud":
            return RouteDecision("cloud", "route hint: cloud")
        if hint == "local":
            return RouteDecision("local", "route hint: local")
        return RouteDecision("local", "auto: the device answers first (difficulty routing is not built yet)")

    async def stream(self, request: GenerationRequest) -> AsyncIterator[StreamEvent]:
        decision = self.decide(request)
        if decision.route == "cloud" and hasattr(self.cloud, "connect"):
            try:
                await self.cloud.connect()
            except Exception as e:  # unreachable at the start: the device answers, and the start event says why
                why = getattr(e, "message", None) or str(e)
                decision = RouteDecision("local", f"cloud unreachable ({why}); answering on the device")
        st = _State()
        t0 = time.perf_counter()
        yield StreamEvent("start", source=decision.route, info={"route": decision.route,
                                                                "route_reason": decision.reason})
        source = decision.route
        while True:
            backend = self.cloud if source == "cloud" else self.local
            part = copy.copy(request)
            part.params = copy.copy(request.params)
            part.params.max_tokens = request.params.max_tokens - st.generated
            failure = None
            async with contextlib.aclosing(backend.stream(part, prefix=request.prefix + st.text)) as events:
                async for ev in events:
                    if ev.type == "start":
                        continue
                    if ev.type == "delta":
                        st.text += ev.text
                        st.ids += ev.token_ids
                        st.generated += len(ev.token_ids)
                        yield StreamEvent("delta", seq=st.seq, text=ev.text, token_ids=list(ev.token_ids),
                                          source=source)
                        st.seq += 1
                    elif ev.type == "finish":
                        st.usage[source] = ev.usage or Usage()
                        total = Usage(st.usage[source].prompt_tokens, st.generated)
                        info = {"usage_by_source": {k: asdict(v) for k, v in st.usage.items()},
                                "handoffs": st.handoffs, "route": decision.route, "route_reason": decision.reason,
                                "total_s": time.perf_counter() - t0}
                        yield StreamEvent("finish", seq=st.seq, finish_reason=ev.finish_reason, usage=total,
                                          source=source, info=info)
                        return
                    else:  # error
                        failure = ev
                        break
            if failure is None:
                yield StreamEvent("error", error="the backend ended the stream without finishing", source=source)
                return
            if source != "cloud" or request.params.max_tokens - st.generated < 1:
                yield failure
                return
            st.usage[source] = Usage(0, st.generated)
            reason = f"cloud {failure.info.get('code', 'error')}: {failure.error}"
            st.handoffs.append({"from": "cloud", "to": "local", "at_char": len(st.text), "reason": reason})
            yield StreamEvent("handoff", seq=st.seq, source="local",
                              info={"from": "cloud", "to": "local", "at_char": len(st.text), "reason": reason})
            source = "local"

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        text, ids, finish, usage, info = [], [], "error", Usage(), {}
        async for ev in self.stream(request):
            if ev.type == "delta":
                text.append(ev.text)
                ids += ev.token_ids
            elif ev.type == "finish":
                finish, usage, info = ev.finish_reason, ev.usage, ev.info
            elif ev.type == "error":
                info = {"error": ev.error, **ev.info}
        return GenerationResult("".join(text), ids, finish, usage, backend="hybrid", timings=info)
