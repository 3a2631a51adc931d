"""The worker's WebSocket protocol, version 1: frame types, parsing and encoding (docs/protocol.md).

Plain Python shared by the server and every client: each frame is one JSON
object in a text message with a `type`. `parse_frame` turns a received message
into a frame dataclass or raises `ProtocolError` with the code, message and
(when the frame had one) request id that the `error` frame must carry;
`encode` does the reverse and leaves out fields that are None.

This module knows nothing about sockets, models or scheduling.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields

from edge_runtime.errors import EdgeRuntimeError
from edge_runtime.request import GenerationRequest, SamplingParams

PROTOCOL_VERSION = 1
MAX_FRAME_BYTES = 1 << 20  # default limit on one received frame
MAX_ID_CHARS = 128
PRIORITIES = ("interactive", "batch")
FINISH_REASONS = ("stop", "length", "cancelled")
PARAM_NAMES = {f.name for f in fields(SamplingParams)}

# error codes
BAD_FRAME = "bad_frame"  # not JSON, binary, not an object, wrong field types
UNKNOWN_TYPE = "unknown_type"
TOO_LARGE = "frame_too_large"
UNSUPPORTED_PROTOCOL = "unsupported_protocol"
INVALID_REQUEST = "invalid_request"  # a generate whose content or params are invalid
CONTEXT_LENGTH = "context_length_exceeded"
BUSY = "busy"  # at a limit: the error carries retry_after
UNKNOWN_STREAM = "unknown_stream"  # resume or cancel of a stream the server does not hold
AUTH_CLOSE_CODE = 4401  # WebSocket close code for a missing or wrong token


class ProtocolError(EdgeRuntimeError):
    """A frame the peer must be told about with an `error` frame (`id` when the frame had one)."""

    def __init__(self, code: str, message: str, id: str | None = None):
        super().__init__(message)
        self.code, self.id = code, id


@dataclass(slots=True)
class Hello:  # client -> server, first frame
    token: str
    protocol: int = PROTOCOL_VERSION
    type: str = "hello"


@dataclass(slots=True)
class Welcome:  # server -> client, answer to hello
    model: str
    limits: dict = field(default_factory=dict)
    tokenizer: str = ""  # fingerprint of the vocabulary ("" when unknown): equal means token ids can travel
    protocol: int = PROTOCOL_VERSION
    type: str = "welcome"


@dataclass(slots=True)
class Generate:  # client -> server
    id: str
    messages: list | None = None
    prompt: str | None = None
    prefix: str = ""
    params: dict = field(default_factory=dict)
    priority: str = "interactive"
    prefix_token_ids: list | None = None  # the prefix's tokens, when client and worker share a tokenizer
    type: str = "generate"

    def to_request(self) -> GenerationRequest:
        """The engine's request; invalid content or params raise ProtocolError(INVALID_REQUEST, id)."""
        try:
            params = SamplingParams(**self.params)
            return GenerationRequest(messages=self.messages, prompt=self.prompt, prefix=self.prefix, params=params,
                                     id=self.id, prefix_token_ids=self.prefix_token_ids)
        except EdgeRuntimeError as e:
            raise ProtocolError(INVALID_REQUEST, e.message, self.id) from None


@dataclass(slots=True)
class Delta:  # server -> client: the next piece of one stream
    id: str
    seq: int
    text: str
    token_ids: list = field(default_factory=list)
    type: str = "delta"


@dataclass(slots=True)
class Done:  # server -> client: the stream ended
    id: str
    finish_reason: str
    usage: dict = field(default_factory=dict)
    type: str = "done"


@dataclass(slots=True)
class Error:  # server -> client
    code: str
    message: str
    id: str | None = None  # absent when the frame that caused it had none
    retry_after: float | None = None  # with code "busy"
    type: str = "error"


@dataclass(slots=True)
class Cancel:  # client -> server
    id: str
    type: str = "cancel"


@dataclass(slots=True)
class Resume:  # client -> server, after a reconnect: replay deltas with seq > after_seq
    id: str
    after_seq: int = -1
    type: str = "resume"


FRAMES = {cls.__dataclass_fields__["type"].default: cls
          for cls in (Hello, Welcome, Generate, Delta, Done, Error, Cancel, Resume)}
Frame = Hello | Welcome | Generate | Delta | Done | Error | Cancel | Resume


def encode(frame: Frame) -> str:
    """One frame as a compact JSON text message (None fields left out)."""
    return json.dumps({k: v for k, v in asdict(frame).items() if v is not None}, ensure_ascii=False,
                      separators=(",", ":"))


def error_frame(exc: ProtocolError | EdgeRuntimeError, id: str | None = None) -> Error:
    return Error(code=getattr(exc, "code", "error"), message=exc.message, id=getattr(exc, "id", None) or id)


def _check(obj: dict, name: str, kinds, id: str | None, required: bool = True, optional_none: bool = False):
    if name not in obj:
        if required:
            raise ProtocolError(BAD_FRAME, f"'{obj.get('type')}' frame needs '{name}'", id)
        return
    value = obj[name]
    if value is None and optional_none:
        return
    if isinstance(value, bool) and bool not in (kinds if isinstance(kinds, tuple) else (kinds,)):
        raise ProtocolError(BAD_FRAME, f"'{name}' must be {_kind_names(kinds)}, not a boolean", id)
    if not isinstance(value, kinds):
        raise ProtocolError(BAD_FRAME, f"'{name}' must be {_kind_names(kinds)}, not {type(value).__name__}", id)


def _kind_names(kinds) -> str:
    names = {str: "a string", int: "an integer", float: "a number", list: "a list", dict: "an object", bool: "a boolean"}
    kinds = kinds if isinstance(kinds, tuple) else (kinds,)
    return " or ".join(names.get(k, k.__name__) for k in kinds)


def parse_frame(message: str | bytes, max_bytes: int = MAX_FRAME_BYTES) -> Frame:
    """A received WebSocket message -> frame. Raises ProtocolError naming what is wrong."""
    if isinstance(message, (bytes, bytearray, memoryview)):
        raise ProtocolError(BAD_FRAME, "binary frames are not part of the protocol: send JSON text frames")
    if len(message) > max_bytes and len(message.encode("utf-8")) > max_bytes:
        raise ProtocolError(TOO_LARGE, f"frame of {len(message.encode('utf-8'))} bytes exceeds the limit of "
                                       f"{max_bytes} bytes")
    try:
        obj = json.loads(message)
    except (json.JSONDecodeError, RecursionError) as e:
        raise ProtocolError(BAD_FRAME, f"frame is not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise ProtocolError(BAD_FRAME, f"frame must be a JSON object, not {type(obj).__name__}")
    raw_id = obj.get("id")
    id = raw_id if isinstance(raw_id, str) else None
    kind = obj.get("type")
    if not isinstance(kind, str):
        raise ProtocolError(BAD_FRAME, "frame needs a string 'type'", id)
    cls = FRAMES.get(kind)
    if cls is None:
        raise ProtocolError(UNKNOWN_TYPE, f"unknown frame type {kind!r} (known: {', '.join(FRAMES)})", id)
    known = set(cls.__dataclass_fields__)
    unknown = sorted(set(obj) - known)
    if unknown:
        raise ProtocolError(BAD_FRAME, f"'{kind}' frame has unknown field(s): {', '.join(unknown)}", id)
    if "id" in known and kind != "error":
        _check(obj, "id", str, None)
        if not 0 < len(obj["id"]) <= MAX_ID_CHARS:
            raise ProtocolError(BAD_FRAME, f"'id' must be 1 to {MAX_ID_CHARS} characters", None)
    _validate(kind, obj, id)
    return cls(**obj)


def _validate(kind: str, obj: dict, id: str | None) -> None:
    if kind == "hello":
        _check(obj, "token", str, None)
        _check(obj, "protocol", int, None)
        if obj["protocol"] != PROTOCOL_VERSION:
            raise ProtocolError(UNSUPPORTED_PROTOCOL, f"protocol {obj['protocol']} is not supported "
                                                      f"(this server speaks {PROTOCOL_VERSION})")
    elif kind == "welcome":
        _check(obj, "model", str, None)
        _check(obj, "limits", dict, None, required=False)
        _check(obj, "protocol", int, None, required=False)
        _check(obj, "tokenizer", str, None, required=False)
    elif kind == "generate":
        _check(obj, "prefix_token_ids", list, id, required=False, optional_none=True)
        _check(obj, "messages", list, id, required=False, optional_none=True)
        _check(obj, "prompt", str, id, required=False, optional_none=True)
        _check(obj, "prefix", str, id, required=False)
        _check(obj, "params", dict, id, required=False)
        _check(obj, "priority", str, id, required=False)
        if (obj.get("messages") is None) == (obj.get("prompt") is None):
            raise ProtocolError(INVALID_REQUEST, "'generate' needs exactly one of 'messages' or 'prompt'", id)
        if obj.get("priority", "interactive") not in PRIORITIES:
            raise ProtocolError(INVALID_REQUEST, f"'priority' must be one of {', '.join(PRIORITIES)}", id)
        unknown = sorted(set(obj.get("params", {})) - PARAM_NAMES)
        if unknown:
            raise ProtocolError(INVALID_REQUEST, f"unknown sampling parameter(s): {', '.join(unknown)}", id)
    elif kind == "delta":
        _check(obj, "seq", int, id)
        _check(obj, "text", str, id)
        _check(obj, "token_ids", list, id, required=False)
    elif kind == "done":
        _check(obj, "finish_reason", str, id)
        _check(obj, "usage", dict, id, required=False)
    elif kind == "error":
        _check(obj, "code", str, id)
        _check(obj, "message", str, id)
        _check(obj, "id", str, None, required=False, optional_none=True)
        _check(obj, "retry_after", (int, float), id, required=False, optional_none=True)
    elif kind == "resume":
        _check(obj, "after_seq", int, id, required=False)
        if obj.get("after_seq", -1) < -1:
            raise ProtocolError(BAD_FRAME, "'after_seq' must be >= -1", id)
