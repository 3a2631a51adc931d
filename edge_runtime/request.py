"""Requests, sampling parameters, stream events and results.

These are the contracts every backend and every front end speaks. They know
nothing about models, tokenizers or the network.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from edge_runtime.errors import InvalidRequestError

FinishReason = Literal["stop", "length", "cancelled", "error"]
EventType = Literal["start", "delta", "handoff", "finish", "error"]


@dataclass(slots=True)
class SamplingParams:
    """Sampling settings. temperature 0 means greedy.

    NOTE: the order of application matches llama.cpp's default chain:
    repetition penalty -> top-k -> top-p -> min-p -> temperature -> draw.
    """

    max_tokens: int = 256
    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    repeat_last_n: int = 64
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False  # keep generating past end-of-turn tokens (benchmarks: exact output lengths)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        def bad(name: str, value: object, rule: str) -> InvalidRequestError:
            return InvalidRequestError(f"invalid {name}={value!r}: {rule}")

        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise bad("max_tokens", self.max_tokens, "must be an integer >= 1")
        for name in ("temperature", "top_p", "min_p", "repetition_penalty"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
                raise bad(name, v, "must be a finite number")
        if self.temperature < 0:
            raise bad("temperature", self.temperature, "must be >= 0")
        if not 0 < self.top_p <= 1:
            raise bad("top_p", self.top_p, "must be in (0, 1]")
        if not 0 <= self.min_p <= 1:
            raise bad("min_p", self.min_p, "must be in [0, 1]")
        if not 1e-6 <= self.repetition_penalty <= 1e6:
            raise bad("repetition_penalty", self.repetition_penalty, "must be in [1e-6, 1e6] (1 = off)")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise bad("top_k", self.top_k, "must be an integer >= 0 (0 disables it)")
        if not isinstance(self.repeat_last_n, int) or self.repeat_last_n < 0:
            raise bad("repeat_last_n", self.repeat_last_n, "must be an integer >= 0")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)
                                      or not -2**63 <= self.seed < 2**64):
            raise bad("seed", self.seed, "must be an integer in [-2**63, 2**64)")
        if not isinstance(self.ignore_eos, bool):
            raise bad("ignore_eos", self.ignore_eos, "must be true or false")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not all(isinstance(s, str) and s for s in self.stop):
            raise bad("stop", self.stop, "must be a list of non-empty strings")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(slots=True)
class GenerationRequest:
    """One generation: chat `messages` (rendered with the model's template) or a raw `prompt`.

    `prefix` is assistant text already emitted that the answer continues from;
    `prefix_token_ids`, when given, are its tokens (same tokenizer), used as they
    are instead of re-tokenizing the text (a hand-off then continues exactly).
    `confidence` asks local backends for the model's entropy and top-1 margin
    at each generated token (delta `info`), which the hybrid router reads.
    `prompt_token_ids` is set on the device by the first to tokenize the request
    (the gateway's context check, the router's size rule, or the engine), with
    `prompt_tokenizer` the fingerprint of the tokenizer that made them: the rest
    use the same ids instead of rendering and tokenizing again (completion.py).
    `cache` asks the response cache to serve and store (auto), stay out (off) or
    generate and overwrite (refresh); `tenant` scopes what it may serve (an API
    key's hash, or "local").
    """

    messages: list[dict] | None = None
    prompt: str | None = None
    params: SamplingParams = field(default_factory=SamplingParams)
    prefix: str = ""
    route: Literal["auto", "local", "cloud"] = "auto"
    local_only: bool = False
    id: str = ""
    prefix_token_ids: list[int] | None = None
    confidence: bool = False
    prompt_token_ids: list[int] | None = None
    prompt_tokenizer: str = ""
    cache: Literal["auto", "off", "refresh"] = "auto"
    tenant: str = "local"

    def __post_init__(self) -> None:
        if (self.messages is None) == (self.prompt is None):
            raise InvalidRequestError("a request needs exactly one of 'messages' or 'prompt'")
        if self.messages is not None:
            if not isinstance(self.messages, list) or not self.messages:
                raise InvalidRequestError("'messages' must be a non-empty list")
            for i, m in enumerate(self.messages):
                if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                    raise InvalidRequestError(f"messages[{i}] must have string 'role' and 'content'")
        elif not isinstance(self.prompt, str):
            raise InvalidRequestError("'prompt' must be a string")
        if self.prefix_token_ids is not None and not (
                isinstance(self.prefix_token_ids, list)
                and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.prefix_token_ids)):
            raise InvalidRequestError("'prefix_token_ids' must be a list of token ids (integers >= 0)")
        if self.route not in ("auto", "local", "cloud"):
            raise InvalidRequestError(f"invalid route={self.route!r}: must be auto, local or cloud")
        if self.cache not in ("auto", "off", "refresh"):
            raise InvalidRequestError(f"invalid cache={self.cache!r}: must be auto, off or refresh")


@dataclass(slots=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0


@dataclass(slots=True)
class StreamEvent:
    """One event of a stream. The user's text is the concatenation of `delta` texts."""

    type: EventType
    seq: int = 0
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    source: str = "local"
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    info: dict = field(default_factory=dict)
    error: str | None = None


@dataclass(slots=True)
class GenerationResult:
    text: str
    token_ids: list[int]
    finish_reason: FinishReason
    usage: Usage
    backend: str
    ttft_ms: float = 0.0
    decode_tok_per_s: float = 0.0
    timings: dict = field(default_factory=dict)
