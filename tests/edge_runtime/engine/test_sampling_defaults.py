"""Sampling defaults for people: chat and serve sample with the model's recommendation (its GGUF's
general.sampling.* keys, written here with the `gguf` package), else llama.cpp's chain with Ollama's repeat
penalty; generate stays greedy; temperature 0 is plain greedy everywhere; and the default poem does not loop."""
import json
import subprocess
import sys
import urllib.request

import pytest

from edge_runtime.engine import sampling_defaults
from edge_runtime.request import GenerationRequest, SamplingParams
from tests.edge_runtime.server.gateway_fixtures import KEY, Gateway
from tests.edge_cli.test_main import ROOT

POEM = [{"role": "user", "content": "Write a poem about the sea in eight lines."}]
RECOMMENDED = {"general.sampling.temp": 0.5, "general.sampling.top_k": 20, "general.sampling.top_p": 0.9}


def test_a_models_recommendation_fills_what_it_sets_and_the_fallback_the_rest():
    none = sampling_defaults.from_metadata({})
    assert none.values == sampling_defaults.FALLBACK and none.from_model == ()
    assert none.values == {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "repetition_penalty": 1.1,
                           "repeat_last_n": 64}
    d = sampling_defaults.from_metadata({**RECOMMENDED, "general.sampling.min_p": 7.0,  # out of range: ignored
                                         "general.sampling.penalty_repeat": "high"})  # not a number: ignored
    assert d.values == {**sampling_defaults.FALLBACK, "temperature": 0.5, "top_k": 20, "top_p": 0.9}
    assert d.from_model == ("temperature", "top_k", "top_p") and "model's recommendation" in d.source
    # a request's own settings win; greedy is plain greedy unless it asks for a penalty
    p = d.params(temperature=1.2, top_k=None, max_tokens=5)
    assert (p.temperature, p.top_k, p.top_p, p.repetition_penalty, p.max_tokens) == (1.2, 20, 0.9, 1.1, 5)
    assert d.params(temperature=0).repetition_penalty == 1.0
    assert d.params(temperature=0, repetition_penalty=1.3).repetition_penalty == 1.3


def _write_recommending_gguf(src: str, dst: str) -> None:
    """A copy of `src` whose metadata carries RECOMMENDED, written by the gguf package."""
    import gguf
    from gguf.scripts.gguf_new_metadata import MetadataDetails, copy_with_new_metadata

    reader = gguf.GGUFReader(src, "r")
    arch = reader.get_field(gguf.Keys.General.ARCHITECTURE).contents()
    writer = gguf.GGUFWriter(dst, arch=arch, endianess=reader.endianess)
    types = {"general.sampling.temp": gguf.GGUFValueType.FLOAT32, "general.sampling.top_k": gguf.GGUFValueType.INT32,
             "general.sampling.top_p": gguf.GGUFValueType.FLOAT32}
    copy_with_new_metadata(reader, writer, {k: MetadataDetails(types[k], v) for k, v in RECOMMENDED.items()}, [])


@pytest.fixture(scope="module")
def recommending_gguf(tmp_path_factory, model_path):
    path = str(tmp_path_factory.mktemp("gguf") / "recommends.gguf")
    _write_recommending_gguf(model_path, path)
    return path


def _chat(*args: str, stdin: str = "/quit\n") -> subprocess.CompletedProcess:
    p = subprocess.run([sys.executable, "-m", "edge_cli", "chat", "--draft", "none", *args], input=stdin,
                       capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert p.returncode == 0, p.stderr
    return p


def _chat_sampling_line(*args: str) -> str:
    return next(line for line in _chat(*args).stderr.splitlines() if line.startswith("[sampling: "))


def test_chat_says_which_defaults_are_in_force(recommending_gguf):
    assert _chat_sampling_line() == ("[sampling: temperature 0.8, top-k 40, top-p 0.95, min-p 0.05, repeat penalty "
                                     "1.1 over the last 64 tokens (llama.cpp's defaults with Ollama's repeat penalty; "
                                     "the model recommends none)]")
    line = _chat_sampling_line("--model", recommending_gguf)
    assert line.startswith("[sampling: temperature 0.5, top-k 20, top-p 0.9, min-p 0.05, repeat penalty 1.1")
    assert "the model's recommendation (temperature, top_k, top_p)" in line
    assert "flags: temperature" in _chat_sampling_line("--model", recommending_gguf, "--temperature", "0.3")
    assert _chat_sampling_line("--temperature", "0") == "[sampling: greedy (--temperature 0)]"


def test_serve_samples_with_the_models_recommendation_where_a_request_sets_none(recommending_gguf):
    g = Gateway("--model", recommending_gguf)
    try:
        req = urllib.request.Request(g.url + "/health", headers={"Authorization": f"Bearer {KEY}"})
        with urllib.request.urlopen(req, timeout=30) as r:
            health = json.loads(r.read())
        assert {k: health["sampling_defaults"][k] for k in ("temperature", "top_k", "top_p", "min_p")} == \
            {"temperature": 0.5, "top_k": 20, "top_p": pytest.approx(0.9), "min_p": 0.05}
    finally:
        g.stop()


def test_the_default_poem_does_not_loop(native_backend):
    """Asked for a poem, the 135M model repeats a line under llama.cpp's settings alone in most seeded answers;
    with the defaults (its repeat penalty added) the answers do not. Plain decoding (no drafts) is the reference."""
    saved = native_backend.drafter, native_backend.draft
    native_backend.set_draft("none")
    try:
        def repeats(params: SamplingParams) -> bool:
            text = native_backend.generate(GenerationRequest(messages=POEM, params=params)).text
            lines = [line.strip() for line in text.splitlines() if line.strip()]
            return len(lines) != len(set(lines))
        seeds = range(6)
        plain = {**sampling_defaults.FALLBACK, "repetition_penalty": 1.0}
        with_penalty = [repeats(sampling_defaults.NONE.params(max_tokens=200, seed=s)) for s in seeds]
        without = [repeats(SamplingParams(max_tokens=200, seed=s, **plain)) for s in seeds]
    finally:
        native_backend.drafter, native_backend.draft = saved
    assert sum(without) >= 4, without  # the problem the default's penalty is for
    assert sum(with_penalty) <= 1, with_penalty


def test_a_chat_poem_with_the_defaults_does_not_repeat_a_line():
    out = _chat("--seed", "3", stdin=POEM[0]["content"] + "\n/quit\n").stdout
    lines = [line.strip() for line in out.splitlines() if line.strip()]
    assert len(lines) >= 2 and len(lines) == len(set(lines)), out
