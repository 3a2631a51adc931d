"""The OpenAI-compatible request bodies, their mapping to our GenerationRequest, and OpenAI-style errors.

Sampling settings a request leaves out come from the server's defaults (the model's recommendation, else
llama.cpp's: sampling_defaults.py); n defaults to 1 as in OpenAI's API. Extensions that
standard clients never send: `top_k`, `min_p`, `repetition_penalty`,
`ignore_eos` (sampling, as vLLM names them), `route` (auto | local | cloud),
`local_only` (privacy: never leave the device) and `cache` (auto | off | refresh: the response cache). Parameters we cannot
honour (n > 1, logprobs, non-zero presence/frequency penalties, tools,
structured output) are rejected with a 400 that names them, never silently
ignored.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from edge_runtime.errors import EdgeRuntimeError
from edge_runtime.request import GenerationRequest, SamplingParams


class APIError(Exception):
    """An error answered in OpenAI's format: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """APIError.body() as the OpenAPI schema publishes it (the gateway's only error shape)."""
    error: ErrorDetail


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")  # unknown fields are checked by hand: a clear 400 naming them
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    # the sampling settings a request leaves out (None) come from the server's defaults (sampling_defaults.py)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    n: int = Field(default=1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=-2**63, le=2**64 - 1)  # what torch.Generator.manual_seed takes
    presence_penalty: float = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2)
    user: str | None = None
    top_k: int | None = Field(default=None, ge=0)
    min_p: float | None = Field(default=None, ge=0, le=1)
    # NOTE: the sampler divides fp32 logits by it; far outside this range they overflow to inf (a NaN draw).
    repetition_penalty: float | None = Field(default=None, ge=1e-6, le=1e6)
    ignore_eos: bool = False
    route: Literal["auto", "local", "cloud"] = "auto"
    local_only: bool = False
    cache: Literal["auto", "off", "refresh"] = "auto"


class ChatCompletionRequest(_Common):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list | None = None
    tool_choice: Any = None
    response_format: dict | None = None


class CompletionRequest(_Common):
    prompt: str | list[str]
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None


# NOTE: a top_p at or below 1/vocab_size keeps only the most likely token, as this does; far smaller ones
# round to 0 in the sampler's fp32 and would drop every token.
MIN_TOP_P = 1e-6

KNOWN_EXTRA = {"logit_bias", "parallel_tool_calls", "metadata", "store", "service_tier", "modalities", "audio",
               "prediction", "reasoning_effort", "web_search_options"}


def _unsupported(req: _Common) -> None:
    def no(param: str, why: str):
        raise APIError(400, f"'{param}' is not supported: {why}", param=param, code="unsupported_parameter")

    if req.n != 1:
        no("n", "this server returns one choice per request (n=1)")
    if req.presence_penalty or req.frequency_penalty:
        no("presence_penalty" if req.presence_penalty else "frequency_penalty",
           "use repetition_penalty (llama.cpp's multiplicative penalty) instead")
    if isinstance(req, ChatCompletionRequest):
        if req.logprobs or req.top_logprobs:
            no("logprobs", "log probabilities are not returned")
        if req.tools or req.tool_choice not in (None, "none"):
            no("tools", "tool calling is not available on this model")
        if req.response_format and req.response_format.get("type", "text") != "text":
            no("response_format", "only text output is available")
    else:
        if req.echo:
            no("echo", "the prompt is not echoed")
        if req.logprobs:
            no("logprobs", "log probabilities are not returned")
        if req.suffix:
            no("suffix", "insertion is not supported")
        if req.best_of not in (None, 1):
            no("best_of", "one candidate per request")
    extra = sorted(set(req.model_extra or {}) - KNOWN_EXTRA)
    if extra:
        raise APIError(400, f"unknown parameter(s): {', '.join(extra)}", param=extra[0], code="unknown_parameter")
    bias = (req.model_extra or {}).get("logit_bias")
    if bias:
        no("logit_bias", "logit biases are not applied")


def _text(content) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise APIError(400, "only text content parts are supported (this model reads text)", param="messages",
                           code="unsupported_content")
        parts.append(part["text"])
    return "".join(parts)


def to_generation_request(req: _Common, default_max_tokens: int, defaults=None) -> GenerationRequest:
    """`defaults` (a SamplingDefaults) fills the sampling settings the request leaves out."""
    from edge_runtime.engine import sampling_defaults

    _unsupported(req)
    max_tokens = getattr(req, "max_completion_tokens", None) or req.max_tokens or default_max_tokens
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    try:
        params = (defaults or sampling_defaults.NONE).params(
            max_tokens=max_tokens, temperature=req.temperature, top_k=req.top_k, min_p=req.min_p,
            top_p=None if req.top_p is None else max(req.top_p, MIN_TOP_P), repetition_penalty=req.repetition_penalty,
            seed=req.seed, stop=stop, ignore_eos=req.ignore_eos)
        if isinstance(req, ChatCompletionRequest):
            messages = [{"role": "system" if m.role == "developer" else m.role, "content": _text(m.content)}
                        for m in req.messages]
            return GenerationRequest(messages=messages, params=params, route=req.route, local_only=req.local_only,
                                     cache=req.cache)
        prompt = req.prompt
        if isinstance(prompt, list):
            if len(prompt) != 1:
                raise APIError(400, "'prompt' must be one string (batched prompts are not supported)", param="prompt",
                               code="unsupported_parameter")
            prompt = prompt[0]
        return GenerationRequest(prompt=prompt, params=params, route=req.route, local_only=req.local_only,
                                 cache=req.cache)
    except EdgeRuntimeError as e:
        raise APIError(400, e.message, code=getattr(e, "code", None)) from None
