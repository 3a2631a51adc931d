"""The labelled set, the calibration recomputed against the shipped file, and the live cache agreeing with it."""
import asyncio
import json

import pytest

from edge_runtime.cache import calibration
from edge_runtime.cache.embedders import EMBEDDERS
from edge_runtime.cache.response_cache import ResponseCache
from edge_runtime.request import StreamEvent, Usage

STORED = json.load(open(calibration.CALIBRATION, encoding="utf-8"))


def test_the_labelled_set_has_every_class_and_enough_pairs():
    pairs = calibration.load_pairs()
    assert len(pairs) >= 400 and len({p["id"] for p in pairs}) == len(pairs)
    counts = {c: sum(p["class"] == c for p in pairs) for c in calibration.HIT_CLASSES + calibration.MISS_CLASSES}
    assert all(counts[c] >= 50 for c in calibration.HIT_CLASSES), counts
    assert all(counts[c] >= 34 for c in calibration.MISS_CLASSES), counts
    assert sum(p["label"] == "hit" for p in pairs) >= 200 and sum(p["label"] == "miss" for p in pairs) >= 200
    assert all((p["label"] == "hit") == (p["class"] in calibration.HIT_CLASSES) for p in pairs)
    assert STORED["pairs"] == len(pairs) and STORED["set_sha256"] == calibration.set_digest()


@pytest.fixture(scope="module", params=sorted(STORED["embedders"]))
def result(request):
    return request.param, calibration.calibrate(EMBEDDERS[request.param](), calibration.load_pairs())


def test_the_shipped_calibration_recomputes(result):
    name, res = result
    stored = STORED["embedders"][name]
    assert res["threshold"] == pytest.approx(stored["threshold"], abs=1e-5)
    for key in ("recall", "false_hit_rate", "false_hits"):
        assert res[key] == pytest.approx(stored[key], abs=1e-9), key
    assert res["cv"]["recall_mean"] == pytest.approx(stored["cv"]["recall_mean"], abs=1e-9)
    assert res["false_hit_rate"] <= calibration.FALSE_HIT_BUDGET


def test_every_near_miss_class_misses_at_the_chosen_setting(result):
    _, res = result
    for cls in calibration.MISS_CLASSES:
        assert res["by_class"][cls]["hit_rate"] == 0.0, cls


def test_the_chosen_embedder_has_the_best_cross_validated_recall():
    best = max(STORED["embedders"], key=lambda n: STORED["embedders"][n]["cv"]["recall_mean"])
    assert STORED["chosen"] == best == calibration.default_embedder()


def test_the_live_cache_decides_as_the_calibration_predicts_scripted_answers(tmp_path):
    """Each pair through a real ResponseCache (SQLite file, wordllama): a scripted answer "A" stored for a,
    then b looked up (the answers are scripted: what is tested is which requests hit)."""
    pairs = calibration.load_pairs()
    emb = EMBEDDERS["wordllama"]()
    f = calibration.features(pairs, emb)
    predicted = calibration.decide(f, calibration.calibrated_threshold("wordllama"))

    async def answer(text):
        yield StreamEvent("delta", text=text, token_ids=[1])
        yield StreamEvent("finish", finish_reason="stop", usage=Usage(3, 1))

    async def run(cache, request, text):
        return [ev async for ev in cache.serve(request, lambda r: answer(text))]

    got = []
    for i, p in enumerate(pairs):
        cache = ResponseCache(str(tmp_path / f"{i}.sqlite3"), "m", emb)
        asyncio.run(run(cache, calibration.request_of(p["a"]), "A"))
        events = asyncio.run(run(cache, calibration.request_of(p["b"]), "B"))
        hit = events[0].type == "start" and events[0].source == "cache"
        assert hit == ("".join(e.text for e in events if e.type == "delta") == "A")
        got.append(hit)
    assert got == predicted.tolist()
