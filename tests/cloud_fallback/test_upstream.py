"""Upstream mode against a real llama-cpp-python OpenAI server on loopback, plus the error table on a mock transport.

The server runs the embedded SmolLM2 model with one thread (two threads on a
shared two-core machine stall at every barrier when the other core is busy).
Requests are greedy and a few tokens long, so answers are deterministic and
the module runs in seconds.
"""
import asyncio
import json
import socket
import subprocess
import sys
import time

import pytest

pytest.importorskip("llama_cpp.server.app")  # the [server] extras: fastapi, uvicorn, sse-starlette
import httpx  # noqa: E402

from cloud_fallback.protocol import Generate  # noqa: E402
from cloud_fallback.upstream import UPSTREAM_ERROR, Upstream, UpstreamDone, UpstreamError, UpstreamPiece  # noqa: E402
from edge_runtime.model.chat_template import ChatTemplate  # noqa: E402

GREEDY = {"temperature": 0, "top_k": 0, "top_p": 1, "min_p": 0, "repeat_penalty": 1}  # ours, as llama.cpp names
COUNTING = [{"role": "user", "content": "Count from 1 to 10, separated by commas."}]
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, base: str, log):
        self.base, self.log = base, log

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def unstreamed(self, path: str, **body) -> dict:
        resp = httpx.post(f"{self.base}{path}", json={**GREEDY, **body}, timeout=60)
        resp.raise_for_status()
        return resp.json()


@pytest.fixture(scope="module")
def server(model_path, tmp_path_factory):
    port = _free_port()
    log = tmp_path_factory.mktemp("llama_server") / "server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "llama_cpp.server", "--model", model_path, "--host", "127.0.0.1",
                                 "--port", str(port), "--n_ctx", "2048", "--n_threads", "1"],
                                stdout=out, stderr=subprocess.STDOUT)
    srv = Server(f"http://127.0.0.1:{port}/v1", log)
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                pytest.fail(f"llama_cpp.server exited with {proc.returncode}:\n{srv.log_text()[-2000:]}")
            try:
                if httpx.get(f"{srv.base}/models", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"llama_cpp.server did not answer within 60 s:\n{srv.log_text()[-2000:]}")
            time.sleep(0.25)
        yield srv
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def template(model_path):
    return ChatTemplate.from_gguf(model_path)


async def _drain(up: Upstream, gen: Generate) -> tuple[list[str], UpstreamDone]:
    pieces, done = [], None
    async for item in up.stream(gen):
        assert done is None, "nothing may follow UpstreamDone"
        if isinstance(item, UpstreamPiece):
            pieces.append(item.text)
        else:
            done = item
    assert isinstance(done, UpstreamDone)
    return pieces, done


def generate(base: str, gen: Generate, **kwargs) -> tuple[list[str], UpstreamDone]:
    async def run():
        up = Upstream(base, **kwargs)
        try:
            await up.open()
            return await _drain(up, gen)
        finally:
            await up.aclose()

    return asyncio.run(run())


def test_open_picks_the_served_model(server):
    async def run(model):
        up = Upstream(server.base, model=model)
        try:
            return await up.open()
        finally:
            await up.aclose()

    served = httpx.get(f"{server.base}/models").json()["data"][0]["id"]
    assert asyncio.run(run(None)) == served
    with pytest.raises(UpstreamError) as e:
        asyncio.run(run("no-such-model"))
    assert e.value.code == "invalid_request" and "no-such-model" in e.value.message and served in e.value.message


def test_chat_streams_the_unstreamed_greedy_answer(server, template):
    pieces, done = generate(server.base, Generate(id="c", messages=FRANCE, params={"max_tokens": 8}), template=template)
    ref = server.unstreamed("/chat/completions", messages=FRANCE, max_tokens=8)
    assert len(pieces) >= 2
    assert "".join(pieces) == ref["choices"][0]["message"]["content"]
    assert done.finish_reason == ref["choices"][0]["finish_reason"] == "length"
    assert done.usage == {k: ref["usage"][k] for k in ("prompt_tokens", "completion_tokens")}  # counted, exactly
    assert done.usage["prompt_tokens"] > 0 and done.usage["completion_tokens"] == 8


def test_raw_prompt(server):
    pieces, done = generate(server.base, Generate(id="p", prompt="The capital of France is", params={"max_tokens": 6}))
    ref = server.unstreamed("/completions", prompt="The capital of France is", max_tokens=6)
    assert "".join(pieces) == ref["choices"][0]["text"] != ""
    assert done.usage == {"prompt_tokens": ref["usage"]["prompt_tokens"], "completion_tokens": 6}


def test_prefix_continues_the_answer(server, template):
    gen = Generate(id="x", messages=COUNTING, prefix="1, 2, 3, 4,", params={"max_tokens": 6})
    pieces, done = generate(server.base, gen, template=template)
    text = "".join(pieces)
    assert text.startswith(" 5"), text  # picks up after the prefix, not a fresh answer
    ref = server.unstreamed("/completions", prompt=template.render(COUNTING) + "1, 2, 3, 4,", max_tokens=6)
    assert text == ref["choices"][0]["text"]
    assert done.usage["prompt_tokens"] == ref["usage"]["prompt_tokens"]


def test_stop_string_ends_the_answer(server):
    pieces, done = generate(server.base, Generate(id="s", prompt="1, 2, 3, 4,", params={"max_tokens": 12,
                                                                                         "stop": [" 7"]}))
    text = "".join(pieces)
    assert text.startswith(" 5") and "7" not in text, text
    assert done.finish_reason == "stop"


def _wait_for_disconnects(server: Server, count: int) -> None:
    deadline = time.monotonic() + 15
    while server.log_text().count("Disconnected from client") < count:
        assert time.monotonic() < deadline, "the engine never saw the client go away"
        time.sleep(0.1)


def test_cancelling_closes_the_response_and_the_next_request_works(server):
    long = Generate(id="long", prompt="1, 2, 3,", params={"max_tokens": 200})

    async def run():
        up = Upstream(server.base)
        await up.open()
        try:
            seen = server.log_text().count("Disconnected from client")
            stream = up.stream(long)
            pieces = []
            async for item in stream:  # the consumer stops after two pieces
                pieces.append(item)
                if len(pieces) == 2:
                    break
            await stream.aclose()
            assert all(isinstance(p, UpstreamPiece) for p in pieces)
            _wait_for_disconnects(server, seen + 1)

            started = asyncio.Event()

            async def consume():
                async for _ in up.stream(long):
                    started.set()

            task = asyncio.create_task(consume())  # the task is cancelled mid-stream
            await started.wait()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            _wait_for_disconnects(server, seen + 2)
            return await _drain(up, Generate(id="after", prompt="1, 2, 3,", params={"max_tokens": 4}))
        finally:
            await up.aclose()

    pieces, done = asyncio.run(run())
    assert "".join(pieces) and done.finish_reason == "length" and done.usage["completion_tokens"] == 4


def test_a_stream_the_engine_interrupts_is_an_error(server):
    """llama-cpp-python's server (default --interrupt_requests) ends a stream with [DONE] when another request comes."""
    async def run():
        up = Upstream(server.base)
        await up.open()
        try:
            first = up.stream(Generate(id="a", prompt="1, 2, 3,", params={"max_tokens": 200}))
            assert isinstance(await first.__anext__(), UpstreamPiece)
            other = asyncio.create_task(_drain(up, Generate(id="b", prompt="1, 2,", params={"max_tokens": 2})))
            with pytest.raises(UpstreamError) as e:
                async for _ in first:
                    pass
            return e.value, await other
        finally:
            await up.aclose()

    err, (pieces, done) = asyncio.run(run())
    assert err.code == UPSTREAM_ERROR and "finish reason" in err.message and "interrupt_requests" in err.message
    assert pieces and done.usage["completion_tokens"] == 2


def test_unreachable_engine():
    base = f"http://127.0.0.1:{_free_port()}/v1"  # nothing listens there

    async def run(call):
        up = Upstream(base, model="m")
        try:
            return await call(up)
        finally:
            await up.aclose()

    with pytest.raises(UpstreamError) as e:
        asyncio.run(run(lambda up: up.open()))
    assert e.value.code == UPSTREAM_ERROR and "unreachable" in e.value.message and base in e.value.message
    with pytest.raises(UpstreamError) as e:
        asyncio.run(run(lambda up: _drain(up, Generate(id="u", prompt="hi"))))
    assert e.value.code == UPSTREAM_ERROR and "unreachable" in e.value.message


def test_prompt_beyond_the_context_window(server):
    with pytest.raises(UpstreamError) as e:
        generate(server.base, Generate(id="big", prompt="hello " * 3000, params={"max_tokens": 8}))
    assert e.value.code == "context_length_exceeded" and "context length is 2048" in e.value.message


@pytest.mark.parametrize("params, words", [({"temperature": -1}, "temperature"), ({"bogus": 1}, "bogus"),
                                           ({"max_tokens": 0}, "max_tokens")])
def test_invalid_params_are_refused_before_sending(params, words):
    up = Upstream("http://127.0.0.1:9/v1", model="m")  # never contacted
    with pytest.raises(UpstreamError) as e:
        asyncio.run(_drain(up, Generate(id="i", prompt="hi", params=params)))
    assert e.value.code == "invalid_request" and words in e.value.message
    asyncio.run(up.aclose())


def _mocked(handler) -> Upstream:
    up = Upstream("http://engine/v1", model="m")
    up._client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    return up


@pytest.mark.parametrize("status, headers, body, code, retry_after, words", [
    (429, {"Retry-After": "3"}, {"error": {"message": "too many requests"}}, "busy", 3.0, "too many requests"),
    (503, {}, {"detail": "overloaded"}, "busy", 1.0, "overloaded"),
    (400, {}, {"error": {"message": "This model's maximum context length is 2048 tokens. However, you requested 4000 "
                                    "tokens", "code": 400}}, "context_length_exceeded", None, "2048"),  # vLLM's words
    (400, {}, {"error": {"message": "the request exceeds the available context size", "type":
                         "exceed_context_size_error"}}, "context_length_exceeded", None, "context size"),  # llama.cpp
    (400, {}, {"error": {"message": "top_k must be at least 1"}}, "invalid_request", None, "top_k must be"),
    (404, {}, {"detail": "Not Found"}, "invalid_request", None, "Not Found"),
    (500, {}, {"error": {"message": "CUDA error"}}, UPSTREAM_ERROR, None, "CUDA error"),
    (502, {}, "bad gateway", UPSTREAM_ERROR, None, "bad gateway"),
])
def test_http_errors_map_to_protocol_codes(status, headers, body, code, retry_after, words):
    content = body.encode() if isinstance(body, str) else json.dumps(body).encode()
    up = _mocked(lambda request: httpx.Response(status, headers=headers, content=content))
    with pytest.raises(UpstreamError) as e:
        asyncio.run(_drain(up, Generate(id="e", prompt="hi")))
    assert (e.value.code, e.value.retry_after) == (code, retry_after) and words in e.value.message


def test_request_body_and_streamed_usage():
    """What an engine that honours stream_options (vLLM, SGLang, llama.cpp server) is sent and sends back."""
    sent = []

    def handler(request):
        sent.append((request.url.path, json.loads(request.content)))
        events = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]},
                  {"choices": [{"index": 0, "delta": {"content": "Hi"}, "finish_reason": None}]},
                  {"choices": [{"index": 0, "delta": {"content": " there"}, "finish_reason": "tool_calls"}]},
                  {"choices": [], "usage": {"prompt_tokens": 12, "completion_tokens": 2, "total_tokens": 14}}]
        sse = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + ": ping\n\ndata: [DONE]\n\n"
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=sse.encode())

    params = {"max_tokens": 5, "temperature": 0.7, "top_k": 20, "repetition_penalty": 1.2, "seed": 7, "stop": ["\n"]}
    gen = Generate(id="m", messages=FRANCE, prefix="Well,", params=params)
    pieces, done = asyncio.run(_drain(_mocked(handler), gen))
    assert pieces == ["Hi", " there"] and done == UpstreamDone("stop", {"prompt_tokens": 12, "completion_tokens": 2})
    path, body = sent[0]
    assert path == "/v1/chat/completions" and body["stream"] and body["stream_options"] == {"include_usage": True}
    assert body["messages"][-1] == {"role": "assistant", "content": "Well,"}  # no template: vLLM's continuation
    assert body["continue_final_message"] is True and body["add_generation_prompt"] is False
    assert body["repetition_penalty"] == body["repeat_penalty"] == 1.2
    assert {k: body[k] for k in ("model", "max_tokens", "temperature", "top_k", "top_p", "min_p", "seed", "stop")} == {
        "model": "m", "max_tokens": 5, "temperature": 0.7, "top_k": 20, "top_p": 1.0, "min_p": 0.0, "seed": 7,
        "stop": ["\n"]}


def test_worker_in_upstream_mode_streams_the_upstream_answer_through_the_protocol(server):
    """`edge-runtime worker --upstream URL` as a real process in front of the real llama.cpp server."""
    from cloud_fallback.client import WorkerClient
    from tests.cloud_fallback.worker_fixtures import WorkerProcess

    expected = server.unstreamed("/chat/completions", messages=FRANCE, max_tokens=24)
    worker = WorkerProcess("--upstream", server.base)
    try:
        async def run():
            async with WorkerClient(worker.url, worker.token) as client:
                assert client.welcome.limits["source"] == "upstream"
                deltas, done = [], None
                async for frame in client.stream(messages=FRANCE, params={"max_tokens": 24}):
                    if frame.type == "delta":
                        deltas.append(frame)
                    else:
                        done = frame
                s = client.stream(messages=COUNTING, params={"max_tokens": 200})
                seen = 0
                async for frame in s:
                    if frame.type == "done":
                        cancelled = frame
                        break
                    seen += 1
                    if seen == 2:
                        await s.cancel()
                return deltas, done, cancelled
        deltas, done, cancelled = asyncio.run(run())
        metrics = worker.metrics()
    finally:
        worker.stop()
    assert len(deltas) >= 2 and [d.seq for d in deltas] == list(range(len(deltas)))
    assert "".join(d.text for d in deltas) == expected["choices"][0]["message"]["content"]
    assert done.finish_reason == expected["choices"][0]["finish_reason"]
    assert done.usage["prompt_tokens"] == expected["usage"]["prompt_tokens"]
    assert cancelled.finish_reason == "cancelled"
    assert metrics["edge_worker_running_requests"] == 0
