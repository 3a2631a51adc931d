"""The SQLite store: expiry, least-recently-used eviction, and writers in several processes at once."""
import multiprocessing
import sqlite3
import time

import numpy as np
import pytest

from edge_runtime.cache.store import CacheStore


def put(store: CacheStore, i: int, tenant: str = "t", text: str = "answer") -> None:
    store.put(tenant, "scope", f"exact-{i}", f"question {i}", {}, "e", np.ones(4, np.float32) / 2,
              {"deltas": [[text, [], "local"]], "finish_reason": "stop", "prompt_tokens": 1, "completion_tokens": 1})


def test_exact_lookup_is_scoped_by_tenant(tmp_path):
    store = CacheStore(str(tmp_path / "c.sqlite3"))
    put(store, 1, tenant="alice")
    assert store.exact("alice", "exact-1").answer["deltas"][0][0] == "answer"
    assert store.exact("bob", "exact-1") is None
    assert [e.query for e in store.candidates("alice", "scope", "e")] == ["question 1"]
    assert store.candidates("bob", "scope", "e") == []
    assert store._db().execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_entries_expire_after_their_ttl(tmp_path):
    store = CacheStore(str(tmp_path / "c.sqlite3"), ttl_s=0.2)
    put(store, 1)
    assert store.exact("t", "exact-1") is not None
    time.sleep(0.3)
    assert store.exact("t", "exact-1") is None and store.candidates("t", "scope", "e") == []
    put(store, 2)  # a write drops what expired
    assert store.stats()["entries"] == 1


def test_least_recently_used_goes_first(tmp_path):
    store = CacheStore(str(tmp_path / "c.sqlite3"), max_entries=3)
    for i in range(3):
        put(store, i)
        time.sleep(0.01)
    store.touch(store.exact("t", "exact-0").id)  # 0 is now the most recently used
    put(store, 3)
    assert store.exact("t", "exact-1") is None
    assert all(store.exact("t", f"exact-{i}") is not None for i in (0, 2, 3))
    size = store.stats()["bytes"]
    small = CacheStore(str(tmp_path / "d.sqlite3"), max_bytes=size // 3 * 2)
    for i in range(4):
        put(small, i)
    assert small.stats()["bytes"] <= size // 3 * 2 and small.exact("t", "exact-3") is not None


def _writer(path: str, k: int) -> None:
    store = CacheStore(path)
    for i in range(25):
        put(store, 1000 * k + i, text=f"{k}-{i}")
        assert store.exact("t", f"exact-{1000 * k}") is not None


def test_writers_in_eight_processes_lose_nothing(tmp_path):
    path = str(tmp_path / "c.sqlite3")
    CacheStore(path)
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(path, k)) for k in range(8)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    store = CacheStore(path)
    assert store.stats()["entries"] == 200
    assert {e["answer"]["deltas"][0][0] for e in store.export()} == {f"{k}-{i}" for k in range(8) for i in range(25)}
    assert store._db().execute("PRAGMA integrity_check").fetchone()[0] == "ok"


def test_a_file_that_is_not_a_database_raises_sqlite_errors(tmp_path):
    path = tmp_path / "c.sqlite3"
    path.write_bytes(b"this is not a database" * 100)
    with pytest.raises(sqlite3.DatabaseError):
        CacheStore(str(path))


def test_embeddings_kept_in_memory_see_other_writers_and_skip_what_they_removed(tmp_path):
    path = str(tmp_path / "c.sqlite3")
    writer, reader = CacheStore(path), CacheStore(path)  # as two processes would
    put(writer, 1)
    ids, emb = reader.embeddings("t", "scope", "e")
    assert len(ids) == 1 and emb.shape == (1, 4)
    for i in range(2, 100):  # past the first buffer's 64 rows
        put(writer, i)
    ids, emb = reader.embeddings("t", "scope", "e")
    assert len(ids) == 99 and emb.shape == (99, 4) and ids == sorted(ids)
    writer.clear()
    ids, _ = reader.embeddings("t", "scope", "e")
    assert ids and reader.entries(ids) == {}  # listed from memory, but gone: the lookup skips them
