"""The hybrid runtime: one ordered stream from the device and the cloud, with hand-offs that lose no text.

`HybridRuntime.stream(request)` yields `start` (the route, its reason and the
rule that decided, see edge_runtime/hybrid/router.py), `delta` events numbered 0, 1,
2, ... across sources (each with `source` local or cloud), a `handoff` event
each time the answer moves (from, to, the character offset, why, and whether
token ids travelled), and one `finish` (reason, usage per source, hand-offs)
or `error`. The user's text is the concatenation of the deltas: a hand-off
continues from exactly that text, so nothing repeats and nothing is skipped.

Hand-offs:
- escalation (local -> cloud): on an auto route the difficulty monitor reads
  the local model's entropy and margin at each token and trips on a hard
  prompt (after its first k tokens) or when confidence collapses later;
- failover (cloud -> local): the cloud stream ends with an error (unreachable,
  killed, stalled past its deadline, an error frame); the device continues;
- hand-back (local -> cloud): only after a failover whose cause a heartbeat
  can clear (the connection was lost or stalled): a probe reconnects and pings
  the cloud; once it answers, the cloud takes the rest if it was faster. An
  error frame over a healthy connection (an upstream or engine error) is not
  cleared by a ping, so that answer stays on the device. At most
  `max_handbacks` hand-backs per answer, and the probe interval doubles after
  each one, so a cloud that keeps failing cannot make the answer flap.

The continuation is an assistant prefix: the text so far, and its token ids
when both sides have the same tokenizer (same fingerprint) and the ids decode
to exactly that text, so the next model continues token for token.

The cloud side is anything with `async stream(request, prefix)` yielding
StreamEvents (cloud_fallback.cloud_backend.CloudBackend); this module does not
import it.
"""
from __future__ import annotations

import asyncio
import contextlib
import copy
import time
from dataclasses import asdict, dataclass, field
from typing import AsyncIterator, Callable

from edge_runtime.engine.completion import build_prompt, prompt_token_ids
from edge_runtime.request import GenerationRequest, GenerationResult, StreamEvent, Usage
from edge_runtime.hybrid.router import RouteDecision, Router, kv_bytes_per_token

HAND_BACK_MODES = ("faster", "always", "never")
# Failover codes that an answered heartbeat clears: the connection was lost or went silent. Any other error
# (upstream_error, internal, busy, ...) came over a working connection, so a ping says nothing about it.
TRANSPORT_CODES = frozenset({"unreachable", "stalled"})


@dataclass
class _State:
    seq: int = 0
    text: str = ""
    ids: list[int] = field(default_factory=list)
    ids_valid: bool = True  # every delta so far carried the ids behind its text
    vocabs: set = field(default_factory=set)  # tokenizer fingerprints of the models that made those ids
    handoffs: list[dict] = field(default_factory=list)
    usage: dict = field(default_factory=dict)  # source -> Usage
    generated: int = 0  # completion tokens so far, all sources
    rate: dict = field(default_factory=dict)  # source -> tokens per second while it streamed
    may_hand_back: bool = False  # the last failover's cause is one a heartbeat clears, and the limit allows one
    num_handbacks: int = 0


class HybridRuntime:
    def __init__(self, local, cloud=None, offline: bool = False, route: str = "auto", router: Router | None = None,
                 policy=None, monitor_factory: Callable | None = None, hand_back: str = "faster",
                 probe_interval: float = 0.5, max_handbacks: int = 2, cache=None):
        """`policy`: a difficulty Calibration (default: the packaged one); `monitor_factory()` overrides the
        monitor it builds; `hand_back`: after a failover caused by a lost or stalled connection, return to the
        cloud `faster` (only if it streamed faster than the device), `always`, or `never`; `probe_interval`:
        seconds between heartbeat probes before the first hand-back of an answer, doubled after each one;
        `max_handbacks`: hand-backs allowed per answer; `cache`: a ResponseCache in front of the router
        (edge_runtime/cache), or None."""
        if hand_back not in HAND_BACK_MODES:
            raise ValueError(f"hand_back must be one of {', '.join(HAND_BACK_MODES)}, not {hand_back!r}")
        if not probe_interval > 0:
            raise ValueError(f"probe_interval must be positive, not {probe_interval!r}")
        if isinstance(max_handbacks, bool) or not isinstance(max_handbacks, int) or max_handbacks < 0:
            raise ValueError(f"max_handbacks must be a non-negative int, not {max_handbacks!r}")
        self.local, self.cloud, self.offline, self.route = local, cloud, offline, route
        if policy is None and monitor_factory is None and router is None:
            policy = _packaged_policy()
        self.policy = policy
        self.router = router or Router(cloud, offline, route, n_ctx=getattr(local, "n_ctx", None),
                                       kv_bytes_per_token=kv_bytes_per_token(local), policy=policy,
                                       watch=monitor_factory is not None)
        self.monitor_factory = monitor_factory or (policy.monitor if policy is not None else None)
        self.hand_back, self.probe_interval, self.max_handbacks = hand_back, probe_interval, max_handbacks
        self.cache = cache

    def prompt_tokens(self, request: GenerationRequest) -> int | None:
        """The prompt's size in the device's tokens, tokenized once per request (the ids stay on it for the
        engine); None for a backend without a tokenizer (the size rule is skipped)."""
        try:
            if request.prefix:
                return len(self.local.tokenize(build_prompt(request, self.local.template)))
            runner = getattr(self.local, "runner", self.local)
            return len(prompt_token_ids(runner, request, self.local.template,
                                        getattr(self.local, "tokenizer_fingerprint", "")))
        except Exception:
            return None

    def decide(self, request: GenerationRequest) -> RouteDecision:
        return self.router.decide(request, self.prompt_tokens(request))

    def _vocab(self, source: str) -> str:
        backend = self.cloud if source == "cloud" else self.local
        return getattr(backend, "tokenizer_fingerprint", "") if backend is not None else ""

    def _ids_for(self, request: GenerationRequest, st: _State, target: str) -> list[int] | None:
        """The prefix's token ids when they can travel to `target`: every id so far came from a model with the
        target's tokenizer, and they decode to exactly the text the user has seen."""
        vocab = self._vocab(target)
        if not st.ids_valid or not vocab or st.vocabs - {vocab} or (request.prefix and request.prefix_token_ids is None):
            return None
        if vocab != self._vocab("local"):
            return None  # the check below decodes with the device's tokenizer
        ids = list(request.prefix_token_ids or []) + st.ids
        try:
            text = b"".join(self.local.runner.token_bytes(t) for t in ids).decode("utf-8")
        except (UnicodeDecodeError, AttributeError):
            return None
        return ids if text == request.prefix + st.text else None

    def handback_delay(self, num_handbacks: int) -> float:
        """Seconds between probes once an answer has been handed back `num_handbacks` times (exponential)."""
        return self.probe_interval * 2 ** num_handbacks

    async def _probe(self, delay: float) -> float:
        """Wait until the cloud answers a heartbeat, trying every `delay` s; returns its round trip (ms)."""
        while True:
            await asyncio.sleep(delay)
            health = getattr(self.cloud, "health", None)
            if health is not None and not health.allow():
                continue
            try:
                await self.cloud.connect()
            except Exception:
                continue
            rtt = await self.cloud.heartbeat() if hasattr(self.cloud, "heartbeat") else 0.0
            if rtt is not None:
                return rtt

    async def stream(self, request: GenerationRequest) -> AsyncIterator[StreamEvent]:
        """The answer's events: from the response cache when it holds this request, else routed and generated
        (and then stored in the cache)."""
        events = self._route(request) if self.cache is None else self.cache.serve(request, self._route,
                                                                                   self.prompt_tokens)
        async with contextlib.aclosing(events) as events:
            async for ev in events:
                yield ev

    async def _route(self, request: GenerationRequest) -> AsyncIterator[StreamEvent]:
        prompt_tokens = self.prompt_tokens(request)
        decision = self.router.decide(request, prompt_tokens)
        warm = None
        if decision.monitor and hasattr(self.cloud, "connect"):  # an escalation should not wait for a handshake
            warm = asyncio.get_running_loop().create_task(self.cloud.connect())
            warm.add_done_callback(lambda t: t.cancelled() or t.exception())
        if decision.route == "cloud" and hasattr(self.cloud, "connect"):
            try:
                await self.cloud.connect()
            except Exception as e:  # unreachable at the start: the device answers, and the start event says why
                why = getattr(e, "message", None) or str(e)
                decision = RouteDecision("local", f"cloud unreachable ({why}); answering on the device",
                                         rule="unreachable")
        st = _State()
        t0 = time.perf_counter()
        yield StreamEvent("start", source=decision.route, info={"route": decision.route, "rule": decision.rule,
                                                                "route_reason": decision.reason,
                                                                "prompt_tokens": prompt_tokens})
        source = decision.route
        monitor = self.monitor_factory() if decision.monitor and self.monitor_factory is not None else None
        while True:
            backend = self.cloud if source == "cloud" else self.local
            part = copy.copy(request)
            part.params = copy.copy(request.params)
            part.params.max_tokens = request.params.max_tokens - st.generated
            part.prefix_token_ids = self._ids_for(request, st, source) if st.text else request.prefix_token_ids
            part.confidence = source == "local" and monitor is not None
            delay = self.handback_delay(st.num_handbacks)
            probe = (asyncio.get_running_loop().create_task(self._probe(delay))
                     if source == "local" and st.may_hand_back else None)
            failure, switch, first, n = None, None, None, 0
            try:
                async with contextlib.aclosing(backend.stream(part, prefix=request.prefix + st.text)) as events:
                    async for ev in events:
                        if ev.type == "start":
                            continue
                        if ev.type == "delta":
                            now = time.perf_counter()
                            first = first or now
                            # an upstream engine's deltas carry no ids: one streamed chunk is one token
                            used = len(ev.token_ids) or int(source == "cloud" and bool(ev.text))
                            n += used
                            st.text += ev.text
                            st.ids += ev.token_ids
                            st.ids_valid &= bool(ev.token_ids) or not ev.text
                            if ev.token_ids:
                                st.vocabs.add(self._vocab(source))
                            st.generated += used
                            yield StreamEvent("delta", seq=st.seq, text=ev.text, token_ids=list(ev.token_ids),
                                              source=source, info={"t": now - t0})
                            st.seq += 1
                            if n > 1:
                                st.rate[source] = (n - 1) / max(now - first, 1e-9)
                            if request.params.max_tokens - st.generated < 1:
                                continue  # the finish is next; no hand-off for nothing
                            if monitor is not None and source == "local" and ev.info:
                                why = monitor.push(ev.info)
                                if why:
                                    monitor, switch = None, f"escalation: {why}"
                                    break
                            if probe is not None and probe.done() and self._worth_handing_back(st):
                                st.num_handbacks += 1
                                switch = (f"hand-back {st.num_handbacks} of at most {self.max_handbacks}: the cloud "
                                          f"answers again (heartbeat {probe.result():.1f} ms, "
                                          f"probed every {delay:g} s)")
                                break
                        elif ev.type == "finish":
                            st.usage[source] = _add(st.usage.get(source), ev.usage or Usage())
                            total = Usage(prompt_tokens or max(u.prompt_tokens for u in st.usage.values()),
                                          st.generated)
                            info = {"usage_by_source": {k: asdict(v) for k, v in st.usage.items()},
                                    "handoffs": st.handoffs, "route": decision.route, "rule": decision.rule,
                                    "route_reason": decision.reason, "total_s": time.perf_counter() - t0}
                            yield StreamEvent("finish", seq=st.seq, finish_reason=ev.finish_reason, usage=total,
                                              source=source, info=info)
                            return
                        else:  # error
                            failure = ev
                            break
            finally:
                if probe is not None:
                    probe.cancel()
            st.usage[source] = _add(st.usage.get(source), Usage(0, n))
            if switch is not None:
                target, reason = "cloud", switch
            elif failure is None:
                yield StreamEvent("error", error="the backend ended the stream without finishing", source=source)
                return
            elif source != "cloud" or request.params.max_tokens - st.generated < 1:
                yield failure
                return
            else:
                target, reason = "local", self._fail_over(st, failure)
            if target == "cloud" and hasattr(self.cloud, "connect"):
                with contextlib.suppress(Exception):  # its stream reports a failure; here we only need the welcome
                    await self.cloud.connect()
            ids = self._ids_for(request, st, target)
            h = {"from": source, "to": target, "at_char": len(st.text), "reason": reason, "token_ids": ids is not None}
            st.handoffs.append(h)
            yield StreamEvent("handoff", seq=st.seq, source=target, info={**h, "t": time.perf_counter() - t0})
            source = target

    def _fail_over(self, st: _State, failure: StreamEvent) -> str:
        """Record why the answer leaves the cloud and whether a heartbeat may bring it back; returns the reason."""
        code = failure.info.get("code", "error")
        reason = f"failover: cloud {code}: {failure.error}"
        st.may_hand_back = False
        if self.hand_back == "never":
            return reason
        if code not in TRANSPORT_CODES:
            return reason + "; no hand-back in this answer (a heartbeat does not clear an error from the cloud)"
        if st.num_handbacks >= self.max_handbacks:
            return reason + f"; no hand-back in this answer (limit of {self.max_handbacks} reached)"
        st.may_hand_back = True
        return reason

    def _worth_handing_back(self, st: _State) -> bool:
        if self.hand_back == "always":
            return True
        cloud, local = st.rate.get("cloud"), st.rate.get("local")
        return cloud is not None and local is not None and cloud > local

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


def _add(a: Usage | None, b: Usage) -> Usage:
    if a is None:
        return Usage(b.prompt_tokens, b.completion_tokens)
    return Usage(a.prompt_tokens or b.prompt_tokens, a.completion_tokens + b.completion_tokens)


def _packaged_policy():
    try:
        from edge_runtime.hybrid.difficulty import load_calibration

        return load_calibration()
    except Exception:  # no calibration shipped for this build: auto stays on the device, and says so
        return None
