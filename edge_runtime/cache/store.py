"""The response cache's storage: one SQLite file (WAL mode), safe under concurrent requests and processes.

One row per cached answer: its tenant, its scope (a hash of everything besides the last message that must
match: model, sampling settings, route, system prompt and earlier turns), its exact key (the scope plus the
normalized last message), the last message's guard signature and embedding, and the answer as its deltas.
Entries expire `ttl_s` after they were written; past `max_entries` or `max_bytes` the least recently used
go first. It knows nothing of requests, embeddings models or streams: bytes and JSON in, bytes and JSON out.

Every method raises `sqlite3.Error` (`sqlite3.DatabaseError` for a file that is not a database or is
corrupt); `ResponseCache` turns that into one report and a cache that is off.
"""
from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
from dataclasses import dataclass

import numpy as np

SCHEMA = """
CREATE TABLE IF NOT EXISTS entries (
    id INTEGER PRIMARY KEY,
    tenant TEXT NOT NULL,
    scope TEXT NOT NULL,
    exact TEXT NOT NULL,
    query TEXT NOT NULL,
    signature TEXT NOT NULL,
    embedder TEXT NOT NULL,
    embedding BLOB,
    answer TEXT NOT NULL,
    bytes INTEGER NOT NULL,
    created REAL NOT NULL,
    last_used REAL NOT NULL,
    hits INTEGER NOT NULL DEFAULT 0,
    UNIQUE (tenant, exact)
);
CREATE INDEX IF NOT EXISTS entries_scope ON entries (tenant, scope, embedder);
CREATE INDEX IF NOT EXISTS entries_lru ON entries (last_used);
CREATE INDEX IF NOT EXISTS entries_created ON entries (created);
-- running totals, kept by the triggers in the writers' own transactions: eviction reads one row
CREATE TABLE IF NOT EXISTS totals (one INTEGER PRIMARY KEY CHECK (one = 1), entries INTEGER NOT NULL,
                                   bytes INTEGER NOT NULL);
INSERT OR IGNORE INTO totals VALUES (1, 0, 0);
CREATE TRIGGER IF NOT EXISTS entries_added AFTER INSERT ON entries BEGIN
    UPDATE totals SET entries = entries + 1, bytes = bytes + NEW.bytes; END;
CREATE TRIGGER IF NOT EXISTS entries_removed AFTER DELETE ON entries BEGIN
    UPDATE totals SET entries = entries - 1, bytes = bytes - OLD.bytes; END;
"""


@dataclass(slots=True)
class Entry:
    id: int
    query: str
    signature: dict
    answer: dict
    embedding: np.ndarray | None = None  # [dim] fp32, unit length


class CacheStore:
    def __init__(self, path: str, ttl_s: float = 7 * 86400, max_entries: int = 10000, max_bytes: int = 256 << 20):
        if not ttl_s > 0 or max_entries < 1 or max_bytes < 1:
            raise ValueError("ttl_s, max_entries and max_bytes must be positive")
        self.path, self.ttl_s, self.max_entries, self.max_bytes = path, ttl_s, max_entries, max_bytes
        self._local = threading.local()  # one connection per thread (sqlite3 objects stay on their thread)
        self._lock = threading.Lock()
        self._memo: dict = {}  # (tenant, scope, embedder) -> the embeddings read so far (see `embeddings`)
        if os.path.dirname(path):
            os.makedirs(os.path.dirname(path), exist_ok=True)
        with self._db() as db:
            db.executescript(SCHEMA)

    def _db(self) -> sqlite3.Connection:
        db = getattr(self._local, "db", None)
        if db is None:
            db = sqlite3.connect(self.path, timeout=10, isolation_level=None)  # autocommit; BEGIN by hand
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
            db.execute("PRAGMA busy_timeout=10000")
            self._local.db = db
        return db

    def close(self) -> None:
        db = getattr(self._local, "db", None)
        if db is not None:
            db.close()
            self._local.db = None

    def exact(self, tenant: str, key: str) -> Entry | None:
        row = self._db().execute(
            "SELECT id, query, signature, answer FROM entries WHERE tenant = ? AND exact = ? AND created > ?",
            (tenant, key, time.time() - self.ttl_s)).fetchone()
        return None if row is None else Entry(row[0], row[1], json.loads(row[2]), json.loads(row[3]))

    def embeddings(self, tenant: str, scope: str, embedder: str) -> tuple[list[int], np.ndarray | None]:
        """The ids and embeddings [n, dim] of one scope's entries embedded by `embedder` (None when none).

        NOTE: kept in memory per scope and topped up with the rows written since (any process's: ids only
        grow), so a lookup reads new rows, not the whole scope. An id evicted or replaced since may still be
        listed: `entries` does not return it, and the caller skips it. Expired ones are left out here."""
        key = (tenant, scope, embedder)
        with self._lock:
            memo = self._memo.setdefault(key, {"max_id": 0, "ids": [], "n": 0, "created": None, "matrix": None})
            new = self._db().execute(
                "SELECT id, created, embedding FROM entries WHERE tenant = ? AND scope = ? AND embedder = ? "
                "AND embedding IS NOT NULL AND id > ? ORDER BY id", (tenant, scope, embedder, memo["max_id"])).fetchall()
            for entry_id, created, blob in new:  # appended in place; the buffers double when full
                row = np.frombuffer(blob, dtype=np.float32)
                if memo["matrix"] is None or memo["n"] == len(memo["matrix"]):
                    grown = np.empty((max(64, 2 * memo["n"]), row.size), np.float32)
                    stamps = np.empty(len(grown))
                    if memo["n"]:
                        grown[:memo["n"]], stamps[:memo["n"]] = memo["matrix"][:memo["n"]], memo["created"][:memo["n"]]
                    memo["matrix"], memo["created"] = grown, stamps
                memo["matrix"][memo["n"]], memo["created"][memo["n"]] = row, created
                memo["ids"].append(entry_id)
                memo["n"], memo["max_id"] = memo["n"] + 1, entry_id
            n = memo["n"]
            if not n:
                return [], None
            live = memo["created"][:n] > time.time() - self.ttl_s
            if live.all():
                return memo["ids"], memo["matrix"][:n]
            return [i for i, ok in zip(memo["ids"], live) if ok], memo["matrix"][:n][live]

    def entries(self, ids: list[int]) -> dict[int, Entry]:
        """Those entries' questions and signatures (not their answers)."""
        marks = ",".join("?" * len(ids))
        rows = self._db().execute(f"SELECT id, query, signature FROM entries WHERE id IN ({marks})", ids)
        return {i: Entry(i, q, json.loads(s), {}) for i, q, s in rows}

    def candidates(self, tenant: str, scope: str, embedder: str) -> list[Entry]:
        """Live entries of one scope with an embedding from `embedder`, with their embeddings."""
        ids, emb = self.embeddings(tenant, scope, embedder)
        found = self.entries(ids) if ids else {}
        return [Entry(i, found[i].query, found[i].signature, {}, emb[k]) for k, i in enumerate(ids) if i in found]

    def answer(self, entry_id: int) -> dict | None:
        row = self._db().execute("SELECT answer FROM entries WHERE id = ?", (entry_id,)).fetchone()
        return None if row is None else json.loads(row[0])

    def touch(self, entry_id: int) -> None:
        self._db().execute("UPDATE entries SET last_used = ?, hits = hits + 1 WHERE id = ?", (time.time(), entry_id))

    def put(self, tenant: str, scope: str, exact: str, query: str, signature: dict, embedder: str,
            embedding: np.ndarray | None, answer: dict) -> None:
        """Insert or replace the entry of (tenant, exact), then evict what is expired or over the limits."""
        blob = None if embedding is None else np.asarray(embedding, dtype=np.float32).tobytes()
        text = json.dumps(answer, ensure_ascii=False)
        size = len(text.encode()) + len(query.encode()) + (len(blob) if blob else 0)
        now = time.time()
        db = self._db()
        db.execute("BEGIN IMMEDIATE")
        try:
            db.execute("INSERT OR REPLACE INTO entries (tenant, scope, exact, query, signature, embedder, embedding, "
                       "answer, bytes, created, last_used) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                       (tenant, scope, exact, query, json.dumps(signature, ensure_ascii=False), embedder, blob, text,
                        size, now, now))
            self._evict(db, now)
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise

    def _evict(self, db: sqlite3.Connection, now: float) -> None:
        db.execute("DELETE FROM entries WHERE created <= ?", (now - self.ttl_s,))
        count, total = db.execute("SELECT entries, bytes FROM totals").fetchone()
        if count <= self.max_entries and total <= self.max_bytes:
            return
        victims, drop, freed = [], count - self.max_entries, 0
        cur = db.execute("SELECT id, bytes FROM entries ORDER BY last_used, id")  # least recently used first
        for entry_id, size in cur:
            if drop <= 0 and total - freed <= self.max_bytes:
                break
            victims.append((entry_id,))
            drop, freed = drop - 1, freed + size
        cur.close()
        db.executemany("DELETE FROM entries WHERE id = ?", victims)

    def stats(self) -> dict:
        count, total, hits = self._db().execute(
            "SELECT COUNT(*), COALESCE(SUM(bytes), 0), COALESCE(SUM(hits), 0) FROM entries").fetchone()
        tenants = self._db().execute("SELECT COUNT(DISTINCT tenant) FROM entries").fetchone()[0]
        return {"path": self.path, "entries": count, "bytes": total, "hits_served": hits, "tenants": tenants,
                "file_bytes": os.path.getsize(self.path) if os.path.exists(self.path) else 0,
                "ttl_s": self.ttl_s, "max_entries": self.max_entries, "max_bytes": self.max_bytes}

    def clear(self) -> int:
        with self._lock:
            self._memo.clear()
        return self._db().execute("DELETE FROM entries").rowcount

    def export(self) -> list[dict]:
        """Every entry without its embedding: tenant, query, signature, answer, sizes and times."""
        rows = self._db().execute("SELECT tenant, scope, query, signature, embedder, answer, bytes, created, "
                                  "last_used, hits FROM entries ORDER BY id")
        return [{"tenant": t, "scope": s, "query": q, "signature": json.loads(sig), "embedder": e,
                 "answer": json.loads(a), "bytes": b, "created": c, "last_used": lu, "hits": h}
                for t, s, q, sig, e, a, b, c, lu, h in rows]
