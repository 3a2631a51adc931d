"""The response cache in front of the router: an answer given once is streamed again, never generated twice.

`ResponseCache.serve(request, generate)` wraps the hybrid runtime's stream, so every entry point (HTTP, SSE,
/v1/stream, `chat`, the Python API) gets it:
- a hit streams like any answer: `start` (route "cache", which tier, its score), the stored deltas with
  `source` "cache", and `finish` whose usage says no tokens were generated (`cached_completion_tokens`
  says how many the stored answer has);
- a miss generates; an answer that finishes (stop or length) is stored, one that errors or is cancelled is not.

Keys: the tenant (request.tenant: an API key's hash, or "local"), then a scope hash over the model
fingerprint, the sampling settings, the route and `local_only`, the system prompt and every earlier turn;
then the last message. Exact tier: the normalized last message (guards.normalize). Semantic tier: of the
TOP_K stored last messages of the same scope nearest by cosine similarity and over `threshold`, the nearest
whose guards all agree (guards.Signature: numbers, negations, quoted strings, entities, language, constraints). So an
earlier turn that differs never hits, and one user never sees another's answer.

Only greedy requests are cached and served unless `sampled=True`. `request.cache`: "auto" (use it), "off"
(bypass), "refresh" (generate and overwrite). A continuation (non-empty `prefix`) bypasses. A cache file that
cannot be opened or read is reported once on stderr and the cache turns itself off: requests never fail
because of it. `audit_share` of hits are regenerated in the background and compared (the live false-hit
rate on /metrics).
"""
from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import random
import sqlite3
import sys
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

import numpy as np

from edge_runtime.cache.guards import Signature, normalize
from edge_runtime.cache.store import CacheStore
from edge_runtime.request import GenerationRequest, StreamEvent, Usage

TOP_K = 8  # semantic candidates checked against the guards per lookup: the nearest, whatever the cache holds
COUNTERS = ("hits_exact", "hits_semantic", "misses", "bypasses", "stores", "errors", "audits", "audit_disagreements")


@dataclass(slots=True)
class CacheHit:
    kind: str  # "exact" | "semantic"
    score: float
    entry_id: int
    query: str
    answer: dict


@dataclass(slots=True)
class _Lookup:
    tenant: str
    scope: str
    exact: str
    query: str
    signature: Signature
    embedding: np.ndarray | None = None
    hit: CacheHit | None = None
    deltas: list = field(default_factory=list)


def request_keys(model: str, request: GenerationRequest) -> tuple[str, str, str]:
    """(scope, exact, query): the hashes that must match for `model`'s answers, and the last message."""
    p = request.params
    sampling = {"max_tokens": p.max_tokens, "temperature": float(p.temperature), "top_k": p.top_k,
                "top_p": float(p.top_p), "min_p": float(p.min_p),
                "repetition_penalty": float(p.repetition_penalty), "repeat_last_n": p.repeat_last_n,
                "seed": None if p.greedy else p.seed, "stop": list(p.stop), "ignore_eos": p.ignore_eos}
    if request.messages is not None:
        *earlier, last = request.messages
        context = [[m["role"], normalize(m["content"])] for m in earlier]
        query = last["content"] if last["role"] == "user" else ""
        if not query:  # a conversation that does not end with the user: the whole of it is the context
            context, query = context + [[last["role"], normalize(last["content"])]], ""
    else:
        context, query = [["prompt"]], request.prompt
    scope = json.dumps([model, sampling, request.route, request.local_only, context], ensure_ascii=False)
    scope = hashlib.sha256(scope.encode()).hexdigest()
    exact = hashlib.sha256(f"{scope}\0{normalize(query)}".encode()).hexdigest()
    return scope, exact, query


class ResponseCache:
    def __init__(self, path: str, model: str, embedder=None, threshold: float | None = None, sampled: bool = False,
                 audit_share: float = 0.0, **store_limits):
        """`model`: the fingerprint of what answers (backends and their model files); `embedder`: an object with
        `name` and `embed(texts)`, or None for the exact tier only; `threshold`: the cosine similarity a
        semantic hit needs (default: the calibrated one for the embedder); `store_limits`: CacheStore's
        ttl_s, max_entries, max_bytes."""
        if not 0.0 <= audit_share <= 1.0:
            raise ValueError(f"audit_share must be in [0, 1], not {audit_share!r}")
        self.model, self.embedder, self.sampled, self.audit_share = model, embedder, sampled, audit_share
        if embedder is not None and threshold is None:
            from edge_runtime.cache.calibration import calibrated_threshold

            threshold = calibrated_threshold(embedder.name)
        self.threshold = threshold
        self.counters = dict.fromkeys(COUNTERS, 0)
        self.broken: str | None = None
        self._audits: set = set()
        self.store: CacheStore | None = None
        try:
            self.store = CacheStore(path, **store_limits)
        except sqlite3.Error as e:
            self._fail(e)

    def _fail(self, e: Exception) -> None:
        """Report once, then run without the cache."""
        self.counters["errors"] += 1
        if self.broken is None:
            self.broken = f"{type(e).__name__}: {e}"
            print(f"edge-runtime: response cache {getattr(self.store, 'path', '')!s} unusable ({self.broken}); "
                  f"answering without it", file=sys.stderr, flush=True)

    def _bypass(self, request: GenerationRequest) -> bool:
        return (self.store is None or self.broken is not None or request.cache == "off" or bool(request.prefix)
                or (not request.params.greedy and not self.sampled))

    # --- lookup -------------------------------------------------------------------------------------
    def lookup(self, request: GenerationRequest) -> _Lookup | None:
        """None when the request bypasses the cache; else its keys and, on a hit, the stored answer."""
        if self._bypass(request):
            self.counters["bypasses"] += 1
            return None
        scope, exact, query = request_keys(self.model, request)
        look = _Lookup(request.tenant, scope, exact, query, Signature.of(query))
        if request.cache == "refresh":
            self.counters["bypasses"] += 1
            look.embedding = self._embed(query)
            return look
        try:
            entry = self.store.exact(look.tenant, exact)
            if entry is not None:
                look.hit = CacheHit("exact", 1.0, entry.id, entry.query, entry.answer)
            elif self.embedder is not None and query:
                look.embedding = self._embed(query)
                look.hit = self._nearest(look)
            if look.hit is not None:
                self.store.touch(look.hit.entry_id)
        except sqlite3.Error as e:
            self._fail(e)
            return None
        self.counters["misses" if look.hit is None else f"hits_{look.hit.kind}"] += 1
        return look

    def _embed(self, query: str) -> np.ndarray | None:
        return None if self.embedder is None or not query else self.embedder.embed([query])[0]

    def _nearest(self, look: _Lookup) -> CacheHit | None:
        """The nearest of the scope's entries (the TOP_K most similar are checked) over the threshold whose
        guards agree."""
        ids, emb = self.store.embeddings(look.tenant, look.scope, self.embedder.name)
        if not ids:
            return None
        scores = emb @ look.embedding
        near = np.argpartition(-scores, TOP_K)[:TOP_K] if len(scores) > TOP_K else np.arange(len(scores))
        top = [int(i) for i in sorted(near, key=lambda i: (-scores[i], i)) if scores[i] >= self.threshold]
        found = self.store.entries([ids[i] for i in top]) if top else {}
        for i in top:
            e = found.get(ids[i])
            if e is not None and look.signature.agrees(Signature.from_json(e.signature)):
                answer = self.store.answer(e.id)
                return None if answer is None else CacheHit("semantic", float(scores[i]), e.id, e.query, answer)
        return None

    # --- the stream ---------------------------------------------------------------------------------
    async def serve(self, request: GenerationRequest, generate: Callable[[GenerationRequest], AsyncIterator],
                    prompt_tokens: Callable[[GenerationRequest], int | None] | None = None):
        """`generate(request)`'s events, or a stored answer's; stores what `generate` finishes."""
        look = self.lookup(request)
        if look is not None and look.hit is not None:
            async for ev in self._replay(look.hit, request, prompt_tokens):
                yield ev
            if self.audit_share and random.random() < self.audit_share:
                self._audit(request, look.hit, generate)
            return
        async with contextlib.aclosing(generate(request)) as events:
            async for ev in events:
                if look is not None and ev.type == "delta":
                    look.deltas.append([ev.text, list(ev.token_ids), ev.source])
                elif look is not None and ev.type == "finish" and ev.finish_reason in ("stop", "length"):
                    self._store(look, ev)
                yield ev

    def _store(self, look: _Lookup, finish: StreamEvent) -> None:
        usage = finish.usage or Usage()
        answer = {"deltas": look.deltas, "finish_reason": finish.finish_reason, "prompt_tokens": usage.prompt_tokens,
                  "completion_tokens": usage.completion_tokens, "stored": time.time()}
        try:
            self.store.put(look.tenant, look.scope, look.exact, look.query, look.signature.to_json(),
                           self.embedder.name if self.embedder is not None else "", look.embedding, answer)
            self.counters["stores"] += 1
        except sqlite3.Error as e:
            self._fail(e)

    async def _replay(self, hit: CacheHit, request: GenerationRequest, prompt_tokens) -> AsyncIterator[StreamEvent]:
        t0 = time.perf_counter()
        answer = hit.answer
        num_prompt = (prompt_tokens(request) if prompt_tokens is not None else None) or answer["prompt_tokens"]
        reason = f"{hit.kind} cache hit" + (f" (similarity {hit.score:.3f} to {hit.query!r})"
                                            if hit.kind == "semantic" else "")
        info = {"route": "cache", "rule": f"cache_{hit.kind}", "route_reason": reason, "prompt_tokens": num_prompt,
                "cache": {"kind": hit.kind, "score": hit.score, "entry": hit.entry_id}}
        yield StreamEvent("start", source="cache", info=info)
        seq = 0
        for text, ids, _source in answer["deltas"]:
            yield StreamEvent("delta", seq=seq, text=text, token_ids=list(ids), source="cache",
                              info={"t": time.perf_counter() - t0})
            seq += 1
        usage = Usage(num_prompt or 0, 0)
        yield StreamEvent("finish", seq=seq, finish_reason=answer["finish_reason"], usage=usage, source="cache",
                          info={**info, "usage_by_source": {"cache": {"prompt_tokens": usage.prompt_tokens,
                                                                      "completion_tokens": 0}},
                                "cached_completion_tokens": answer["completion_tokens"], "handoffs": [],
                                "total_s": time.perf_counter() - t0})

    def _audit(self, request: GenerationRequest, hit: CacheHit, generate) -> None:
        """Regenerate a hit's request in the background and count whether the text differs."""
        async def run():
            text = []
            async with contextlib.aclosing(generate(request)) as events:
                async for ev in events:
                    if ev.type == "delta":
                        text.append(ev.text)
            self.counters["audits"] += 1
            if "".join(text) != "".join(d[0] for d in hit.answer["deltas"]):
                self.counters["audit_disagreements"] += 1
        task = asyncio.get_running_loop().create_task(run())
        self._audits.add(task)
        task.add_done_callback(self._audits.discard)

    # --- reporting ----------------------------------------------------------------------------------
    def stats(self) -> dict:
        out = {**self.counters, "enabled": self.broken is None, "broken": self.broken, "threshold": self.threshold,
               "embedder": getattr(self.embedder, "name", None), "sampled": self.sampled}
        if self.store is not None and self.broken is None:
            try:
                out.update(self.store.stats())
            except sqlite3.Error as e:
                self._fail(e)
        return out

    def metrics(self) -> list[str]:
        """Prometheus lines: hits by tier, misses, bypasses, stores, errors, audits; entries and bytes."""
        s = self.stats()
        lines = ["# HELP edge_cache_requests_total Response cache lookups by outcome.",
                 "# TYPE edge_cache_requests_total counter"]
        for outcome in ("hits_exact", "hits_semantic", "misses", "bypasses"):
            lines.append(f'edge_cache_requests_total{{outcome="{outcome}"}} {s[outcome]}')
        for name, key, help_ in [("edge_cache_stores_total", "stores", "Answers stored."),
                                 ("edge_cache_errors_total", "errors", "Cache file errors (the cache turns off)."),
                                 ("edge_cache_audits_total", "audits", "Hits regenerated in the background."),
                                 ("edge_cache_audit_disagreements_total", "audit_disagreements",
                                  "Audited hits whose regenerated text differs (live false hits).")]:
            lines += [f"# HELP {name} {help_}", f"# TYPE {name} counter", f"{name} {s[key]}"]
        for name, key, help_ in [("edge_cache_entries", "entries", "Entries stored."),
                                 ("edge_cache_bytes", "bytes", "Bytes of stored entries.")]:
            lines += [f"# HELP {name} {help_}", f"# TYPE {name} gauge", f"{name} {s.get(key, 0)}"]
        return lines
