"""Continuous batching on the device, through a real `edge-runtime serve` and the official `openai` client:
concurrent requests share engine steps, each answer equal to the same request answered alone; a short request does not wait for a long answer; a client that leaves frees its
KV blocks at once; --max-batch 1 keeps one request at a time."""
import concurrent.futures
import json
import threading
import time
import urllib.request

import openai
import pytest

from tests.edge_runtime.server.gateway_fixtures import KEY, Gateway

QUESTIONS = ["Explain how a rainbow forms.", "What is the capital of France?", "Write a haiku about autumn.",
             "List three prime numbers.", "Why is the sky blue?", "Name a famous painter.",
             "How do bees make honey?", "What is 12 times 7?"]


@pytest.fixture(scope="module")
def client(gw):
    return openai.OpenAI(base_url=gw.url + "/v1", api_key=KEY, max_retries=0, timeout=300)


def health(gw) -> dict:
    req = urllib.request.Request(gw.url + "/health", headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def ask(client, question: str, max_tokens: int = 40, **kw):
    return client.chat.completions.create(model="default", messages=[{"role": "user", "content": question}],
                                          max_tokens=max_tokens, temperature=0, **kw)


def test_concurrent_greedy_answers_share_steps_and_equal_each_one_alone(gw, client, native_backend):
    from edge_runtime.request import GenerationRequest, SamplingParams

    answers = [None] * len(QUESTIONS)

    def go(i):
        answers[i] = ask(client, QUESTIONS[i])
    threads = [threading.Thread(target=go, args=(i,)) for i in range(len(QUESTIONS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for q, r in zip(QUESTIONS, answers):  # the single-stream path, plain decoding, in this process
        alone = native_backend.generate(GenerationRequest(messages=[{"role": "user", "content": q}],
                                                          params=SamplingParams(max_tokens=40)))
        assert r.choices[0].message.content == alone.text, q
        assert r.usage.completion_tokens == alone.usage.completion_tokens
        assert r.usage.prompt_tokens == alone.usage.prompt_tokens
        assert r.model_extra["x_hybrid"]["segments"][0]["source"] == "local"
    engine = health(gw)["local_engine"]
    assert engine["max_sequences"] >= 2, engine  # steps really carried several requests
    assert "concurrent requests share decode steps (up to 8 sequences per step)" in gw.banner
    assert engine["num_running"] == 0 and engine["num_jobs"] == 0
    assert engine["draft"]["method"] == "mtp-attn-ngram"  # serve's --draft auto: lookup, else the attention head


def test_a_short_request_does_not_wait_for_a_long_answer(client):
    long_done, first_long = threading.Event(), threading.Event()

    def long():
        for chunk in client.chat.completions.create(
                model="default", messages=[{"role": "user", "content": "Write a very long story about a dragon."}],
                max_tokens=400, temperature=0, stream=True, extra_body={"ignore_eos": True}):
            if chunk.choices and chunk.choices[0].delta.content:
                first_long.set()
        long_done.set()
    t = threading.Thread(target=long)
    t.start()
    assert first_long.wait(120)
    short = ask(client, "What is the capital of France?", max_tokens=8)
    short_first = not long_done.is_set()  # the short answer is whole while the long one still streams
    t.join()
    assert short.choices[0].message.content and short_first


def test_a_client_that_leaves_frees_its_kv_blocks(gw, client):
    def long_stream():
        s = client.chat.completions.create(
            model="default", messages=[{"role": "user", "content": "Write a very long story about a dragon."}],
            max_tokens=400, temperature=0, stream=True, extra_body={"ignore_eos": True})
        for i, _ in enumerate(s):
            if i == 5:
                return s
    first, stream = long_stream(), long_stream()
    assert health(gw)["local_engine"]["num_jobs"] == 2
    first.close()
    stream.close()  # the connections go: the gateway cancels, the engine frees the blocks
    deadline = time.time() + 30
    while health(gw)["local_engine"]["num_jobs"] and time.time() < deadline:
        time.sleep(0.1)
    engine = health(gw)["local_engine"]
    assert engine["num_jobs"] == 0 and engine["num_running"] == 0, engine


def test_max_batch_one_keeps_one_request_at_a_time():
    g = Gateway("--max-batch", "1")
    try:
        assert health(g)["local_engine"]["max_batch"] == 1 and "one request at a time (native)" in g.banner
        c = openai.OpenAI(base_url=g.url + "/v1", api_key=KEY, max_retries=0, timeout=300)
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            answers = list(pool.map(lambda q: ask(c, q, max_tokens=4), ["What is the capital of France?",
                                                                       "Name a colour.", "Say hello."]))
        assert all(a.choices[0].message.content for a in answers)
        assert health(g)["local_engine"]["max_sequences"] == 1  # no step ever carried two of them
    finally:
        g.stop()
