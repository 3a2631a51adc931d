"""Property-based fuzzing of a real `edge-runtime serve` process from its own /openapi.json (schemathesis).

The promise under test: no request body makes the gateway answer 5xx, every non-2xx answer is JSON in
OpenAI's error format, and answers conform to the schema the gateway publishes. Generation stays real but
short: the gateway runs with `--default-max-tokens 4` and a hook clamps `max_tokens` and
`max_completion_tokens` to at most 8; valid bodies stream or not. Runs are derandomized (hypothesis's
`derandomize`: a seed fixed by the test's code), so CI sees the same examples every time. Hand-written
bodies add what a schema-driven generator does not send: raw NaN/Infinity, numbers past int64, lone
surrogates, invalid UTF-8, deep nesting, giant strings, wrong content types.

Not covered here: the WebSocket endpoint (tests/edge_runtime/server/test_ws_stream.py) and what the
answers say (test_openai_api.py).
"""
import json
import zlib

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (content_type_conformance, response_headers_conformance,
                                               response_schema_conformance, status_code_conformance)

from tests.edge_runtime.server.gateway_fixtures import KEY, Gateway

AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_FUZZ_TOKENS = 8
# What the gateway promises for anything a client can get wrong (its 503 means the device failed with no cloud).
ERROR_STATUSES = {400, 401, 404, 429}
# (operation, generation mode, examples): about 250 requests, under a minute here.
RUNS = [
    ("POST /v1/chat/completions", GenerationMode.POSITIVE, 80),
    ("POST /v1/chat/completions", GenerationMode.NEGATIVE, 50),
    ("POST /v1/completions", GenerationMode.POSITIVE, 60),
    ("POST /v1/completions", GenerationMode.NEGATIVE, 40),
    ("GET /v1/models", GenerationMode.POSITIVE, 3),
    ("GET /health", GenerationMode.POSITIVE, 3),
    ("GET /metrics", GenerationMode.POSITIVE, 3),
]


@pytest.fixture(scope="module")
def gw():
    g = Gateway("--default-max-tokens", "4")
    yield g
    g.stop()


@pytest.fixture(scope="module")
def schema(gw):
    schema = schemathesis.openapi.from_url(gw.url + "/openapi.json", config=schemathesis.Config())

    @schema.hook
    def map_case(context, case):
        """Keep generation short. Valid bodies also go to the served model (a random name is a 404; the
        hand-written cases cover that), half of them without what the gateway refuses by design (n, tools,
        ...) so they reach real generation, and a third each with `stream` as generated, false and true (the
        generator seldom sets it). Those choices hang on a hash of the body: fixed for a given example."""
        body = case.body
        if not isinstance(body, dict):
            return case
        for name in ("max_tokens", "max_completion_tokens"):
            v = body.get(name)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and v > MAX_FUZZ_TOKENS:
                body[name] = 1 + int(v) % MAX_FUZZ_TOKENS  # JSON Schema's integers include 9.0
        if case.meta is not None and case.meta.generation.mode == GenerationMode.POSITIVE:
            choice = zlib.crc32(ascii(body).encode())
            body["model"] = "default"
            if choice % 3:
                body["stream"] = choice % 3 == 2
            if choice // 3 % 2:
                _strip_refused(case)
        return case

    return schema


# What the gateway honours; the rest of its schema (n, penalties, logprobs, tools, echo, suffix, best_of,
# response_format, unknown fields) it answers with a 400 that names the parameter.
HONOURED = {"model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p", "stream",
            "stream_options", "stop", "seed", "user", "top_k", "min_p", "repetition_penalty", "ignore_eos", "route",
            "local_only"}


def _strip_refused(case) -> None:
    body = case.body = {k: v for k, v in case.body.items() if k in HONOURED}
    if isinstance(body.get("prompt"), list):  # batched prompts are refused: one string
        body["prompt"] = body["prompt"][0] if body["prompt"] else ""
    for message in body.get("messages", []):
        if isinstance(message.get("content"), list):  # so are content parts that are not text
            message["content"] = "".join(part.get("text") or "" for part in message["content"]
                                         if isinstance(part.get("text"), str))


def openai_error_format(ctx, response, case):
    """Every non-2xx is one of the promised statuses with a JSON body {"error": {message, type, param, code}}."""
    if response.status_code < 300:
        return None
    assert response.status_code in ERROR_STATUSES, f"status {response.status_code} is not one the gateway promises"
    _check_error_body(response.headers.get("content-type", [""])[0], response.text)
    return True


def sse_events_are_json(ctx, response, case):
    """A streamed answer is SSE: JSON chunks (or OpenAI-format errors) and a final [DONE]."""
    if response.status_code != 200 or not _is_sse(response.headers.get("content-type", [""])[0]):
        return None
    _check_sse(response.text)
    return True


CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_headers_conformance,
          response_schema_conformance, openai_error_format, sse_events_are_json]


def _is_sse(content_type: str) -> bool:
    return content_type.startswith("text/event-stream")


def _check_error_body(content_type: str, text: str) -> None:
    assert content_type.startswith("application/json"), content_type
    body = json.loads(text)
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str), err
    assert err["param"] is None or isinstance(err["param"], str), err
    assert err["code"] is None or isinstance(err["code"], str), err


def _check_sse(text: str) -> None:
    events = [line[len("data: "):] for line in text.split("\n") if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]", text[-500:]
    for data in events[:-1]:
        chunk = json.loads(data)
        if "error" in chunk:
            _check_error_body("application/json", data)
        else:
            assert isinstance(chunk["choices"], list), chunk


@pytest.mark.parametrize("label, mode, num_examples", RUNS, ids=[f"{r[0]}-{r[1].value}" for r in RUNS])
def test_fuzzed_requests_get_no_5xx_and_openai_errors(gw, schema, label, mode, num_examples):
    method, path = label.split(" ")
    operation = schema[path][method]
    seen = {}  # status (or "streamed"): count

    @settings(max_examples=num_examples, derandomize=True, database=None, deadline=None, print_blob=False,
              phases=[Phase.explicit, Phase.generate, Phase.shrink],
              suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(generation_mode=mode))
    def run(case):
        response = case.call_and_validate(base_url=gw.url, headers=AUTH, checks=CHECKS, timeout=60)
        seen[response.status_code] = seen.get(response.status_code, 0) + 1
        if response.status_code == 200 and method == "POST":
            if _is_sse(response.headers["content-type"][0]):
                seen["streamed"] = seen.get("streamed", 0) + 1
            else:
                assert response.json()["usage"]["completion_tokens"] <= MAX_FUZZ_TOKENS  # the clamp held

    run()
    print(label, mode.value, "statuses:", seen)
    assert gw.proc.poll() is None, "the gateway died"
    if mode == GenerationMode.POSITIVE and method == "POST":  # valid bodies did reach real generation
        assert seen.get(200, 0) >= num_examples // 3, seen  # the rest: parameters refused by design (n, tools, ...)
        assert num_examples // 10 <= seen.get("streamed", 0) < seen[200], seen  # streamed and whole answers


HUGE = 10**400
NESTED = "[" * 100_000 + "]" * 100_000
NASTY = {  # name: (body, content type); a dict is the body's fields besides the prompt ("content", default "Hi")
    "empty body": ("", "application/json"),
    "not json": ("{model: default", "application/json"),
    "json null": ("null", "application/json"),
    "json string": ('"hello"', "application/json"),
    "json number": ("42", "application/json"),
    "json array": ('[{"model": "default"}]', "application/json"),
    "huge max_tokens (400 digits)": ({"max_tokens": HUGE, "stream": True}, "application/json"),
    "max_tokens past int64": ({"max_tokens": 2**63, "stream": True}, "application/json"),
    "max_tokens 1e400 (inf)": ('{"model": "default", "prompt": "Hi", "messages": [], "max_tokens": 1e400}',
                               "application/json"),
    "huge seed": ({"max_tokens": 2, "seed": HUGE}, "application/json"),
    "seed past uint64": ({"max_tokens": 2, "seed": 2**64}, "application/json"),
    "seed below int64": ({"max_tokens": 2, "seed": -2**63 - 1}, "application/json"),
    "negative seed": ({"max_tokens": 2, "seed": -5}, "application/json"),
    "huge top_k": ({"max_tokens": 2, "top_k": HUGE}, "application/json"),
    "NaN temperature": ({"max_tokens": 2, "temperature": float("nan")}, "application/json"),
    "Infinity repetition_penalty": ({"max_tokens": 2, "repetition_penalty": float("inf")}, "application/json"),
    "-Infinity top_p": ({"max_tokens": 2, "top_p": float("-inf")}, "application/json"),
    "NaN min_p": ({"max_tokens": 2, "min_p": float("nan")}, "application/json"),
    "tiny temperature": ({"max_tokens": 2, "temperature": 5e-324}, "application/json"),
    "tiny top_p": ({"max_tokens": 2, "top_p": 5e-324}, "application/json"),
    "tiny min_p": ({"max_tokens": 2, "min_p": 5e-324}, "application/json"),
    "huge repetition_penalty": ({"max_tokens": 2, "repetition_penalty": 1e308}, "application/json"),
    "tiny repetition_penalty": ({"max_tokens": 2, "repetition_penalty": 5e-324}, "application/json"),
    "wrong types": ('{"model": 1, "messages": {"role": "user"}, "prompt": 2, "max_tokens": "many", "stream": "yes"}',
                    "application/json"),
    "prompt/messages not text": ({"content": [1, "two", None]}, "application/json"),
    "content part without text": ({"content": [{"type": "text"}]}, "application/json"),
    "content part text not a string": ({"content": [{"type": "text", "text": 5}]}, "application/json"),
    "deeply nested content": ('{"model": "default", "messages": [{"role": "user", "content": ' + NESTED + '}]}',
                              "application/json"),
    "deeply nested body": (NESTED, "application/json"),
    "unicode and NUL": ({"max_tokens": 2, "content": "\0 h\u00e9llo \U0001f600 \u202e \uffff \u4f60\u597d"},
                        "application/json"),
    "lone surrogate": ({"max_tokens": 2, "content": "\ud800"}, "application/json"),
    "lone surrogate, streamed": ({"max_tokens": 2, "stream": True, "content": "x\udfff"}, "application/json"),
    "lone surrogate model name": ({"max_tokens": 2, "model": "gpt-\ud800"}, "application/json"),
    "lone surrogate parameter name": ({"max_tokens": 2, "x\udc00": 1}, "application/json"),
    "lone surrogate stop": ({"max_tokens": 2, "stop": ["\ud800"]}, "application/json"),
    "invalid utf-8": (b'{"model": "default", "prompt": "\xff\xfe", "messages": [{"role": "user", "content": "\xff"}]}',
                      "application/json"),
    "wrong content-type": ({"max_tokens": 2}, "text/plain"),
    "form content-type": ("model=default&messages=hi", "application/x-www-form-urlencoded"),
    "giant string": ({"content": "ab " * 700_000}, "application/json"),
    "giant stop list": ({"max_tokens": 2, "stop": ["x"] * 50_000}, "application/json"),
    "empty stop string": ({"max_tokens": 2, "stop": ""}, "application/json"),
    "stream_options wrong": ({"max_tokens": 2, "stream": True, "stream_options": 3}, "application/json"),
    "duplicate keys": ('{"model": "default", "prompt": "Hi", "messages": [{"role": "user", "content": "Hi"}], '
                       '"max_tokens": 2, "max_tokens": 0}', "application/json"),
}


def _render(body, path: str):
    if not isinstance(body, dict):
        return body
    fields = dict(body)
    content = fields.pop("content", "Hi")
    ask = {"messages": [{"role": "user", "content": content}]} if path.endswith("/chat/completions") else \
        {"prompt": content}
    return json.dumps({"model": "default", **ask, **fields})


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize("name", list(NASTY))
def test_hand_written_nasty_bodies(gw, name, path):
    body, content_type = NASTY[name]
    with httpx.stream("POST", gw.url + path, content=_render(body, path), timeout=60,
                      headers={**AUTH, "Content-Type": content_type}) as r:
        if r.status_code == 200 and _is_sse(r.headers["content-type"]):
            lines = []
            for line in r.iter_lines():  # a stream with no end (max_tokens 10**400) is cut short: that cancels it
                lines.append(line)
                if line == "data: [DONE]" or len(lines) > 40:
                    break
            if lines[-1] != "data: [DONE]":
                lines.append("data: [DONE]")
            text = "\n".join(lines)
        else:
            text = r.read().decode("utf-8")
    assert r.status_code < 500, (r.status_code, text[:500])
    if r.status_code >= 300:
        assert r.status_code in ERROR_STATUSES, (r.status_code, text[:500])
        _check_error_body(r.headers.get("content-type", ""), text)
    elif _is_sse(r.headers["content-type"]):
        _check_sse(text)
    else:
        assert json.loads(text)["choices"], text[:500]
    assert gw.proc.poll() is None, "the gateway died"


@pytest.mark.parametrize("method, path", [("GET", "/v1/nope"), ("DELETE", "/v1/chat/completions"),
                                          ("GET", "/v1/chat/completions"), ("PUT", "/v1/models")])
def test_unknown_routes_and_methods_answer_in_openais_format(gw, method, path):
    r = httpx.request(method, gw.url + path, headers=AUTH)
    assert 400 <= r.status_code < 500, (r.status_code, r.text)
    _check_error_body(r.headers.get("content-type", ""), r.text)


def test_still_healthy_after_the_fuzzing(gw):
    r = httpx.post(gw.url + "/v1/chat/completions", headers=AUTH,
                   json={"model": "default", "messages": [{"role": "user", "content": "Hi"}]}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 4  # --default-max-tokens 4
    assert "edge_gateway_in_flight 0" in httpx.get(gw.url + "/metrics").text
