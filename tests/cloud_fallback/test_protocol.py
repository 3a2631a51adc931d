"""The WebSocket protocol module: every frame round-trips; every malformed frame gets a named error."""
import json

import pytest

from cloud_fallback import protocol as p


@pytest.mark.parametrize("frame", [
    p.Hello(token="secret"),
    p.Welcome(model="SmolLM2-135M-Instruct", limits={"max_tokens": 2048}),
    p.Generate(id="r1", messages=[{"role": "user", "content": "hi"}], params={"max_tokens": 64, "temperature": 0}),
    p.Generate(id="r2", prompt="Once upon", prefix=" a time", priority="batch"),
    p.Delta(id="r1", seq=0, text="Hel", token_ids=[19556]),
    p.Done(id="r1", finish_reason="stop", usage={"prompt_tokens": 5, "completion_tokens": 2}),
    p.Error(code="busy", message="too many streams", id="r1", retry_after=1.5),
    p.Error(code="bad_frame", message="frame is not valid JSON"),
    p.Cancel(id="r1"),
    p.Resume(id="r1", after_seq=3),
])
def test_every_frame_round_trips(frame):
    text = p.encode(frame)
    assert json.loads(text)["type"] == frame.type
    assert "null" not in text  # None fields are left out
    assert p.parse_frame(text) == frame


def test_documented_examples_parse():
    g = p.parse_frame('{"type":"generate","id":"r1","messages":[{"role":"user","content":"Hi"}],"prefix":"",'
                      '"params":{"max_tokens":64,"temperature":0}}')
    req = g.to_request()
    assert req.id == "r1" and req.params.max_tokens == 64 and req.params.greedy
    assert p.parse_frame('{"type":"hello","protocol":1,"token":"t"}') == p.Hello(token="t")
    assert p.parse_frame('{"type":"resume","id":"r1","after_seq":7}').after_seq == 7


@pytest.mark.parametrize("message, code, id, words", [
    (b'{"type":"cancel","id":"r1"}', p.BAD_FRAME, None, "binary"),
    ("not json", p.BAD_FRAME, None, "not valid JSON"),
    ("[1, 2]", p.BAD_FRAME, None, "JSON object"),
    ('{"id":"r1"}', p.BAD_FRAME, "r1", "string 'type'"),
    ('{"type":"launch","id":"r9"}', p.UNKNOWN_TYPE, "r9", "unknown frame type 'launch'"),
    ('{"type":"cancel"}', p.BAD_FRAME, None, "needs 'id'"),
    ('{"type":"cancel","id":7}', p.BAD_FRAME, None, "'id' must be a string"),
    ('{"type":"cancel","id":""}', p.BAD_FRAME, None, "1 to 128 characters"),
    ('{"type":"generate","id":"r1"}', p.INVALID_REQUEST, "r1", "exactly one of"),
    ('{"type":"generate","id":"r1","prompt":"a","messages":[]}', p.INVALID_REQUEST, "r1", "exactly one of"),
    ('{"type":"generate","id":"r1","prompt":5}', p.BAD_FRAME, "r1", "'prompt' must be a string"),
    ('{"type":"generate","id":"r1","prompt":"a","params":[]}', p.BAD_FRAME, "r1", "'params' must be an object"),
    ('{"type":"generate","id":"r1","prompt":"a","params":{"temprature":1}}', p.INVALID_REQUEST, "r1", "temprature"),
    ('{"type":"generate","id":"r1","prompt":"a","priority":"urgent"}', p.INVALID_REQUEST, "r1", "priority"),
    ('{"type":"generate","id":"r1","prompt":"a","colour":"red"}', p.BAD_FRAME, "r1", "unknown field(s): colour"),
    ('{"type":"hello","protocol":2,"token":"t"}', p.UNSUPPORTED_PROTOCOL, None, "protocol 2"),
    ('{"type":"hello","protocol":1}', p.BAD_FRAME, None, "needs 'token'"),
    ('{"type":"resume","id":"r1","after_seq":true}', p.BAD_FRAME, "r1", "not a boolean"),
    ('{"type":"resume","id":"r1","after_seq":-5}', p.BAD_FRAME, "r1", ">= -1"),
])
def test_malformed_frames_are_named(message, code, id, words):
    with pytest.raises(p.ProtocolError) as info:
        p.parse_frame(message)
    assert info.value.code == code and info.value.id == id and words in info.value.message
    err = p.error_frame(info.value)
    assert p.parse_frame(p.encode(err)) == err  # the error itself is a valid frame


def test_oversize_frame_is_refused_before_parsing():
    big = json.dumps({"type": "generate", "id": "r1", "prompt": "x" * 2000})
    with pytest.raises(p.ProtocolError) as info:
        p.parse_frame(big, max_bytes=1000)
    assert info.value.code == p.TOO_LARGE and "limit of 1000 bytes" in info.value.message


def test_invalid_sampling_values_become_invalid_request_with_id():
    g = p.parse_frame('{"type":"generate","id":"r5","prompt":"a","params":{"top_p":0}}')
    with pytest.raises(p.ProtocolError) as info:
        g.to_request()
    assert info.value.code == p.INVALID_REQUEST and info.value.id == "r5" and "top_p" in info.value.message
    g = p.parse_frame('{"type":"generate","id":"r6","messages":[{"role":"user"}]}')
    with pytest.raises(p.ProtocolError, match="messages\\[0\\]"):
        g.to_request()
