"""The response cache on the hybrid runtime's Python API, with the real native backend."""
import asyncio
import contextlib

from edge_runtime.cache import ResponseCache
from edge_runtime.cache.embedders import WordLlamaEmbedder
from edge_runtime.hybrid.runtime import HybridRuntime
from edge_runtime.request import GenerationRequest, SamplingParams


def req(text: str, **kw) -> GenerationRequest:
    return GenerationRequest(messages=[{"role": "user", "content": text}], params=SamplingParams(max_tokens=12), **kw)


def test_the_python_api_stores_and_serves_and_never_stores_a_cut_answer(native_backend, tmp_path):
    cache = ResponseCache(str(tmp_path / "c.sqlite3"), "native-test", WordLlamaEmbedder())
    rt = HybridRuntime(native_backend, offline=True, cache=cache)
    first = asyncio.run(rt.generate(req("Name a planet.")))
    second = asyncio.run(rt.generate(req("Name a planet.")))
    assert first.timings["route"] == "local" and second.timings["route"] == "cache"
    assert second.text == first.text and second.token_ids == first.token_ids
    assert second.usage.completion_tokens == 0 and second.timings["cached_completion_tokens"] == 12
    assert asyncio.run(rt.generate(req("Name a planet.", tenant="other"))).timings["route"] == "local"

    async def cut_short():  # a client that leaves after two deltas
        deltas = 0
        async with contextlib.aclosing(rt.stream(req("Name a river."))) as events:
            async for ev in events:
                deltas += ev.type == "delta"
                if deltas == 2:
                    break
    asyncio.run(cut_short())
    assert asyncio.run(rt.generate(req("Name a river."))).timings["route"] == "local"  # nothing was stored
    assert cache.counters["hits_exact"] == 1 and cache.counters["stores"] == 3


def test_a_cache_file_broken_while_serving_is_reported_once(native_backend, tmp_path, capfd):
    path = tmp_path / "c.sqlite3"
    cache = ResponseCache(str(path), "native-test", None)
    rt = HybridRuntime(native_backend, offline=True, cache=cache)
    asyncio.run(rt.generate(req("Name a colour.")))
    cache.store.close()
    for suffix in ("", "-wal", "-shm"):
        if (tmp_path / f"c.sqlite3{suffix}").exists():
            (tmp_path / f"c.sqlite3{suffix}").write_bytes(b"\0broken" * 512)
    results = [asyncio.run(rt.generate(req("Name a colour."))) for _ in range(3)]
    assert all(r.finish_reason == "length" and r.text and r.timings["route"] == "local" for r in results)
    assert cache.broken and capfd.readouterr().err.count("response cache") == 1
