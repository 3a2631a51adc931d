"""The gateway as users reach it: a real `edge-runtime serve` process, driven by the official `openai` client
(and raw HTTP for what the client hides: status codes, headers, SSE extension fields)."""
import json
import re
import time

import httpx
import openai
import pytest

from tests.edge_runtime.server.gateway_fixtures import KEY, Gateway

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def client(gw):
    return openai.OpenAI(base_url=gw.url + "/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def test_models_list(client):
    models = client.models.list().data
    assert len(models) == 1 and models[0].id.startswith("SmolLM2-135M-Instruct") and models[0].object == "model"


def test_chat_completion_equals_the_local_greedy_answer(client, model, native_backend):
    from edge_runtime.request import GenerationRequest, SamplingParams

    r = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=16, temperature=0)
    local = native_backend.generate(GenerationRequest(messages=QUESTION, params=SamplingParams(max_tokens=16)))
    assert r.choices[0].message.content == local.text and local.text.strip()
    assert r.choices[0].finish_reason == local.finish_reason and r.object == "chat.completion"
    assert r.usage.completion_tokens == local.usage.completion_tokens
    assert r.usage.prompt_tokens == local.usage.prompt_tokens
    hybrid = r.model_extra["x_hybrid"]  # the extension standard clients ignore
    assert hybrid["route"] == "local" and hybrid["segments"] == [{"source": "local", "text": local.text}]


def test_streamed_chat_joins_to_the_whole_answer_with_sources(client, model):
    whole = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=20, temperature=0)
    stream = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=20, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    sources = {c.model_extra.get("x_source") for c in chunks if c.choices and c.choices[0].delta.content}
    assert sources == {"local"}


def test_completions_streaming_and_not(client, model):
    r = client.completions.create(model=model, prompt="The capital of France is", max_tokens=8, temperature=0)
    s = "".join(c.choices[0].text for c in client.completions.create(
        model=model, prompt="The capital of France is", max_tokens=8, temperature=0, stream=True) if c.choices)
    assert r.object == "text_completion" and r.choices[0].text == s and r.usage.completion_tokens == 8


def test_sampled_answers_are_reproducible_with_a_seed(client, model):
    a, b = (client.chat.completions.create(model=model, messages=QUESTION, max_tokens=12, temperature=0.9, seed=7)
            .choices[0].message.content for _ in range(2))
    assert a == b


@pytest.mark.parametrize("kwargs, status, code", [
    ({"temperature": 5}, 400, "invalid_value"),
    ({"n": 2}, 400, "unsupported_parameter"),
    ({"max_tokens": 0}, 400, "invalid_value"),
    ({"model": "gpt-9"}, 404, "model_not_found"),
    ({"extra_body": {"frobnicate": 1}}, 400, "unknown_parameter"),
    ({"messages": [{"role": "user", "content": "word " * 5000}]}, 400, "context_length_exceeded"),
])
def test_errors_come_in_openais_format(client, model, kwargs, status, code):
    args = {"model": model, "messages": QUESTION, "max_tokens": 4, **kwargs}
    with pytest.raises(openai.APIStatusError) as e:
        client.chat.completions.create(**args)
    assert e.value.status_code == status and e.value.body["code"] == code and e.value.body["message"]
    assert client.chat.completions.create(model=model, messages=QUESTION, max_tokens=2).choices  # still healthy


def test_a_wrong_key_is_401(gw):
    bad = openai.OpenAI(base_url=gw.url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        bad.models.list()
    assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
    assert httpx.post(gw.url + "/v1/chat/completions", json={}).status_code == 401


def test_malformed_bodies_are_400_not_500(gw):
    h = {"Authorization": f"Bearer {KEY}"}
    for body in ["not json", "[]", json.dumps({"model": "default"}), json.dumps({"model": 3, "messages": "x"})]:
        r = httpx.post(gw.url + "/v1/chat/completions", content=body, headers={**h, "Content-Type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", (body, r.text)


def test_health_metrics_openapi(gw):
    assert httpx.get(gw.url + "/health").json()["status"] == "ok"
    metrics = httpx.get(gw.url + "/metrics").text
    assert "edge_gateway_requests_total" in metrics and 'edge_gateway_tokens_total{source="local"}' in metrics
    spec = httpx.get(gw.url + "/openapi.json").json()
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models"} <= set(spec["paths"])


def test_a_client_that_disconnects_cancels_its_generation(gw, client, model):
    h = {"Authorization": f"Bearer {KEY}"}
    body = {"model": model, "messages": [{"role": "user", "content": "Write a very long story."}],
            "max_tokens": 2000, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", gw.url + "/v1/chat/completions", json=body, headers=h, timeout=60) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 10:
                break
    deadline = time.time() + 20
    while time.time() < deadline and "edge_gateway_in_flight 0" not in httpx.get(gw.url + "/metrics").text:
        time.sleep(0.1)
    metrics = httpx.get(gw.url + "/metrics").text
    assert "edge_gateway_in_flight 0" in metrics and "edge_gateway_cancelled_total 1" in metrics
    t = time.time()  # the device is free again at once: a short answer does not wait behind 2000 tokens
    assert client.chat.completions.create(model=model, messages=QUESTION, max_tokens=4).choices
    tokens = int(re.search(r'edge_gateway_tokens_total\{source="local"\} (\d+)', httpx.get(gw.url + "/metrics").text)[1])
    assert tokens < 1000, (tokens, time.time() - t)


def test_busy_is_429_with_retry_after_and_the_running_answer_is_unharmed():
    g = Gateway("--max-in-flight", "1")
    try:
        h = {"Authorization": f"Bearer {KEY}"}
        body = {"model": "default", "messages": QUESTION, "max_tokens": 200, "stream": True, "ignore_eos": True,
                "temperature": 0}
        with httpx.stream("POST", g.url + "/v1/chat/completions", json=body, headers=h, timeout=120) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data:"))
            busy = httpx.post(g.url + "/v1/chat/completions", headers=h, timeout=30,
                              json={"model": "default", "messages": QUESTION, "max_tokens": 2})
            rest = [line for line in lines if line.startswith("data:")]
        assert busy.status_code == 429 and busy.headers["retry-after"] == "1"
        assert busy.json()["error"]["code"] == "busy" and busy.json()["error"]["type"] == "rate_limit_error"
        assert json.loads(first[5:])["choices"][0]["delta"]["role"] == "assistant" and rest[-1] == "data: [DONE]"
        chunks = [json.loads(x[5:]) for x in rest[:-1]]
        assert sum(1 for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content") is not None) == 200
        ok = httpx.post(g.url + "/v1/chat/completions", headers=h, timeout=60,
                        json={"model": "default", "messages": QUESTION, "max_tokens": 2})
        assert ok.status_code == 200  # the slot is free again
        assert "edge_gateway_busy_total 1" in httpx.get(g.url + "/metrics").text
    finally:
        g.stop()


def test_a_prompt_too_long_names_the_field_it_came_in(client, model):
    long = "word " * 5000
    with pytest.raises(openai.BadRequestError) as chat:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": long}], max_tokens=4)
    with pytest.raises(openai.BadRequestError) as completion:
        client.completions.create(model=model, prompt=long, max_tokens=4)
    assert chat.value.body["code"] == completion.value.body["code"] == "context_length_exceeded"
    assert chat.value.body["param"] == "messages" and completion.value.body["param"] == "prompt"


def test_max_tokens_beyond_the_context_is_refused_up_front(client, model):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=QUESTION, max_tokens=10**6)
    assert e.value.body["code"] == "context_length_exceeded" and e.value.body["param"] == "max_tokens"
    assert "lower max_tokens to" in e.value.body["message"]


def test_every_sse_terminal_path_carries_the_documented_fields(gw, model):
    """Raw SSE on each way a streamed answer ends: a natural end and a stop string (finish_reason "stop"),
    max_tokens ("length"). The finishing chunk carries finish_reason, x_source and x_usage_by_source; with
    include_usage a usage chunk follows (no choices; prompt, completion and total tokens); then [DONE].
    (A client that leaves instead cancels the answer: test_a_client_that_disconnects_cancels_its_generation.)"""
    sky = [{"role": "user", "content": "Reply with one word: what color is the sky?"}]

    def stream(**body):
        with httpx.stream("POST", gw.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                          json={"model": model, "messages": sky, "temperature": 0, "stream": True,
                                "stream_options": {"include_usage": True}, **body}, timeout=60) as r:
            assert r.status_code == 200
            lines = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
        assert lines[-1] == "[DONE]"
        chunks = [json.loads(x) for x in lines[:-1]]
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
        return chunks, text

    natural, text = stream(max_tokens=200)
    words = text.split()
    stopped, stopped_text = stream(max_tokens=200, stop=[words[2]])
    short, _ = stream(max_tokens=3)
    for chunks, reason in ((natural, "stop"), (stopped, "stop"), (short, "length")):
        finishing = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
        assert len(finishing) == 1 and finishing[0]["choices"][0]["finish_reason"] == reason
        fin = finishing[0]
        assert fin["x_source"] == "local" and set(fin["x_usage_by_source"]) == {"local"}
        usage = chunks[-1]
        assert usage["choices"] == [] and chunks.index(fin) == len(chunks) - 2
        u = usage["usage"]
        assert u["prompt_tokens"] > 0 and u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
        assert fin["x_usage_by_source"]["local"]["completion_tokens"] == u["completion_tokens"]
        assert all(c["id"] == chunks[0]["id"] and c["object"] == "chat.completion.chunk" and c["model"] == model
                   for c in chunks)
    assert natural[-1]["usage"]["completion_tokens"] < 200 and short[-1]["usage"]["completion_tokens"] == 3
    assert words[2] not in stopped_text and text.startswith(stopped_text)
