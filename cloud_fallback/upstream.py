"""The worker's upstream mode: forward a `generate` to an OpenAI-compatible engine and stream its answer back.

`Upstream` turns one protocol `Generate` into a streamed POST to an existing
engine (vLLM, SGLang, llama.cpp server, llama-cpp-python's server), parses the
server-sent events itself and yields `UpstreamPiece`s then one `UpstreamDone`.
Every failure becomes an `UpstreamError` carrying a protocol error code.
Closing the generator (or cancelling its task) closes the HTTP response at
once, which is how the engine learns to stop generating.

Sampling parameters are validated with our `SamplingParams` and sent in full,
so our defaults (greedy, no top-k, no penalty) hold whatever the engine's own
defaults are. `repetition_penalty` goes out under both names, `repeat_penalty`
(llama.cpp) and `repetition_penalty` (vLLM, SGLang), with `repeat_last_n`:
all of these engines ignore body fields they do not know (vLLM logs a
warning), and llama-cpp-python's server silently drops `repetition_penalty`,
`stream_options`, `continue_final_message` and `add_generation_prompt`.
NOTE: vLLM applies its repetition penalty to the whole sequence, llama.cpp to
the last `repeat_last_n` tokens.

This module knows nothing about WebSockets, frames on the wire, scheduling or
tokenizers: token ids are not forwarded and usage is what the engine reports
(or, for an engine that streams no usage, a count described in `stream`).
"""
from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httpx

from edge_runtime.model.chat_template import ChatTemplate
from edge_runtime.errors import EdgeRuntimeError
from edge_runtime.request import SamplingParams

from cloud_fallback.protocol import BUSY, CONTEXT_LENGTH, INVALID_REQUEST, Generate

UPSTREAM_ERROR = "upstream_error"  # the engine is unreachable, failed (5xx) or broke off a stream
DEFAULT_RETRY_AFTER = 1.0
_CONTEXT_WORDS = re.compile(r"context[ _](length|window|size)|exceed_context_size", re.IGNORECASE)


class UpstreamError(EdgeRuntimeError):
    """The upstream engine refused or failed a request; `code` is a protocol error code."""

    def __init__(self, code: str, message: str, retry_after: float | None = None):
        super().__init__(message)
        self.code, self.retry_after = code, retry_after


@dataclass(slots=True)
class UpstreamPiece:
    text: str
    token_ids: list[int] = field(default_factory=list)


@dataclass(slots=True)
class UpstreamDone:
    finish_reason: str  # "stop" | "length"
    usage: dict = field(default_factory=dict)  # prompt_tokens, completion_tokens


class Upstream:
    """A client of one OpenAI-compatible engine at `base_url` (e.g. http://host:8000/v1)."""

    def __init__(self, base_url: str, api_key: str | None = None, model: str | None = None,
                 template: ChatTemplate | None = None, timeout: float = 600.0):
        """`template`, when given, renders chat requests that continue a prefix locally (see `stream`)."""
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.template = template
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(timeout, connect=min(timeout, 10.0)))
        self._count_url: str | None = None  # llama-cpp-python's token counter, found by `open`

    async def open(self) -> str:
        """Check the engine answers and choose the model.

        Returns:
            the model name: `model` if given (it must be served), else the first one the engine lists.
        Raises:
            UpstreamError: unreachable engine, refused key, no models, or `model` not served.
        """
        url = f"{self.base_url}/models"
        try:
            resp = await self._client.get(url)
        except httpx.TransportError as e:
            raise UpstreamError(UPSTREAM_ERROR, f"upstream engine unreachable at {url}: {_describe(e)}; "
                                                "is it running, and does the URL end in /v1?") from None
        if resp.status_code != 200:
            raise _http_error(resp.status_code, resp.headers, resp.text, url)
        try:
            served = [m["id"] for m in resp.json()["data"]]
        except (ValueError, KeyError, TypeError):
            raise UpstreamError(UPSTREAM_ERROR, f"{url} did not answer with an OpenAI model list: "
                                                f"{resp.text[:200]!r}") from None
        if not served:
            raise UpstreamError(UPSTREAM_ERROR, f"upstream engine at {self.base_url} serves no model")
        if self.model is None:
            self.model = served[0]
        elif self.model not in served:
            raise UpstreamError(INVALID_REQUEST, f"upstream engine does not serve model {self.model!r} "
                                                 f"(it serves: {', '.join(served)})")
        await self._find_token_counter()
        return self.model

    async def stream(self, gen: Generate) -> AsyncIterator[UpstreamPiece | UpstreamDone]:
        """Generate `gen` upstream: zero or more pieces, then exactly one `UpstreamDone`.

        Routes: `prompt` -> /completions with prompt + prefix; `messages` without prefix ->
        /chat/completions; `messages` with a prefix -> rendered with `template` and sent to
        /completions, or, without a template, /chat/completions with the prefix as a final assistant
        message and vLLM's `continue_final_message` (engines without it start a new answer instead).
        Usage is the engine's (asked for with `stream_options.include_usage`). An engine that streams
        none (llama-cpp-python's server) gets completion_tokens = the chunks that carried text (one
        token each there) and prompt_tokens from its /extras/tokenize/count, asked before the request:
        exact for a prompt, or for messages rendered with `template`; without a template, only the
        message contents are counted (the engine's template adds more).
        Raises:
            UpstreamError: with code invalid_request, context_length_exceeded, busy or upstream_error.
        """
        path, body = self._request(gen)
        url = f"{self.base_url}{path}"
        num_prompt = await self._count_tokens(body) if self._count_url else 0
        usage, finish, num_chunks, done, answered = None, None, 0, False, False
        for attempt in range(2):
            try:
                async with self._client.stream("POST", url, json=body) as resp:
                    if resp.status_code != 200:
                        text = (await resp.aread()).decode("utf-8", "replace")
                        raise _http_error(resp.status_code, resp.headers, text, url)
                    answered = True
                    async for line in resp.aiter_lines():
                        if not line.startswith("data:"):
                            continue  # blank separators, comments (pings), event:/id: lines
                        data = line[5:].strip()
                        if data == "[DONE]":
                            done = True
                            break
                        chunk = json.loads(data)
                        if "error" in chunk:  # vLLM reports a failure mid-stream this way
                            raise _error_from_body(500, {}, chunk, url)
                        usage = chunk.get("usage") or usage
                        for choice in chunk.get("choices") or []:
                            delta = choice.get("delta")
                            text = delta.get("content") if isinstance(delta, dict) else choice.get("text")
                            if text:
                                num_chunks += 1
                                yield UpstreamPiece(text)
                            finish = choice.get("finish_reason") or finish
                break
            except httpx.TransportError as e:
                if not answered:
                    if attempt == 0 and isinstance(e, (httpx.RemoteProtocolError, httpx.ReadError)):
                        continue  # NOTE: a pooled keep-alive connection the engine had closed: send once more
                    raise UpstreamError(UPSTREAM_ERROR, f"upstream engine unreachable at {url}: {_describe(e)}") from None
                if num_chunks or finish:
                    raise UpstreamError(UPSTREAM_ERROR, f"upstream stream from {url} broke off: {_describe(e)}") from None
                break
            except json.JSONDecodeError as e:
                raise UpstreamError(UPSTREAM_ERROR, f"upstream sent an event that is not JSON: {e}") from None
        if finish is None:
            if num_chunks == 0 and not done:
                raise await self._diagnose(url, body)
            raise UpstreamError(UPSTREAM_ERROR, "upstream ended the stream without a finish reason (llama-cpp-python's "
                                                "server does so when another request arrives unless started with "
                                                "--interrupt_requests False)")
        if not usage:
            usage = {"prompt_tokens": num_prompt, "completion_tokens": num_chunks}
        yield UpstreamDone("length" if finish == "length" else "stop",
                           {"prompt_tokens": int(usage.get("prompt_tokens") or 0),
                            "completion_tokens": int(usage.get("completion_tokens") or 0)})

    async def aclose(self) -> None:
        await self._client.aclose()

    def _request(self, gen: Generate) -> tuple[str, dict]:
        """(path, JSON body) for `gen`."""
        body = {**({"model": self.model} if self.model else {}), **_sampling_body(gen.params), "stream": True,
                "stream_options": {"include_usage": True}}
        if gen.prompt is not None:
            return "/completions", {**body, "prompt": gen.prompt + gen.prefix}
        if not gen.prefix:
            return "/chat/completions", {**body, "messages": gen.messages}
        if self.template is not None:  # NOTE: the template writes any BOS text; vLLM/SGLang then add none
            return "/completions", {**body, "prompt": self._render(gen.messages) + gen.prefix,
                                    "add_special_tokens": False}
        messages = [*gen.messages, {"role": "assistant", "content": gen.prefix}]
        return "/chat/completions", {**body, "messages": messages, "continue_final_message": True,
                                     "add_generation_prompt": False}

    def _render(self, messages: list) -> str:
        try:
            return self.template.render(messages, add_generation_prompt=True)
        except EdgeRuntimeError as e:
            raise UpstreamError(INVALID_REQUEST, e.message) from None

    async def _find_token_counter(self) -> None:
        """Use llama-cpp-python's /extras/tokenize/count when the engine has it (it streams no usage)."""
        root = self.base_url[:-3] if self.base_url.endswith("/v1") else self.base_url
        try:
            resp = await self._client.post(f"{root}/extras/tokenize/count", json={"input": "x"}, timeout=5.0)
            if resp.status_code == 200 and isinstance(resp.json().get("count"), int):
                self._count_url = f"{root}/extras/tokenize/count"
        except (httpx.HTTPError, ValueError, AttributeError):
            pass

    async def _count_tokens(self, body: dict) -> int:
        """Prompt tokens by the engine's counter: exact for a prompt, or for messages when a template was given."""
        if "prompt" in body:
            text = body["prompt"]
        elif self.template is not None:
            text = self._render(body["messages"])
        else:  # NOTE: contents only: the engine's template adds its own tokens
            text = "\n".join(str(m.get("content") or "") for m in body["messages"] if isinstance(m, dict))
        try:
            resp = await self._client.post(self._count_url, json={"input": text}, timeout=10.0)
            return int(resp.json()["count"]) if resp.status_code == 200 else 0
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            return 0

    async def _diagnose(self, url: str, body: dict) -> UpstreamError:
        """The error for a stream that closed before any event.

        llama-cpp-python's server answers a streamed request it cannot serve (a prompt beyond its
        context) with 200 and an empty stream; the same request unstreamed, one token long, gets
        its error message.
        """
        probe = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
        for attempt in range(2):  # NOTE: the broken stream may leave a dead keep-alive connection in the pool
            try:
                resp = await self._client.post(url, json={**probe, "max_tokens": 1})
                break
            except httpx.TransportError as e:
                if attempt:
                    return UpstreamError(UPSTREAM_ERROR, f"upstream engine unreachable at {url}: {_describe(e)}")
        if resp.status_code != 200:
            return _http_error(resp.status_code, resp.headers, resp.text, url)
        return UpstreamError(UPSTREAM_ERROR, f"upstream closed the stream from {url} before sending anything")


def _sampling_body(params: dict) -> dict:
    """Our sampling params (validated, defaults filled in) as OpenAI + llama.cpp + vLLM body fields."""
    try:
        p = SamplingParams(**params)
    except TypeError:
        unknown = sorted(set(params) - set(SamplingParams.__dataclass_fields__))
        raise UpstreamError(INVALID_REQUEST, f"unknown sampling parameter(s): {', '.join(unknown)}") from None
    except EdgeRuntimeError as e:
        raise UpstreamError(INVALID_REQUEST, e.message) from None
    body = {"max_tokens": p.max_tokens, "temperature": p.temperature, "top_p": p.top_p,
            "top_k": p.top_k,  # 0 = off for llama.cpp and current vLLM
            "min_p": p.min_p, "repetition_penalty": p.repetition_penalty, "repeat_penalty": p.repetition_penalty,
            "repeat_last_n": p.repeat_last_n}
    if p.seed is not None:
        body["seed"] = p.seed
    if p.stop:
        body["stop"] = list(p.stop)
    if p.ignore_eos:  # vLLM, SGLang and llama.cpp's server know it
        body["ignore_eos"] = True
    return body


def _describe(e: Exception) -> str:
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


def _http_error(status: int, headers, text: str, url: str) -> UpstreamError:
    try:
        body = json.loads(text)
    except ValueError:
        body = {"message": text.strip()[:500]}
    return _error_from_body(status, headers, body if isinstance(body, dict) else {"message": str(body)}, url)


def _error_from_body(status: int, headers, body: dict, url: str) -> UpstreamError:
    """An HTTP status plus an OpenAI-style (or FastAPI-style) error body -> UpstreamError."""
    err = body.get("error", body)
    if isinstance(err, dict):
        message, code = err.get("message") or err.get("detail") or "", str(err.get("code") or err.get("type") or "")
    else:
        message, code = str(err), ""
    message = (message if isinstance(message, str) else json.dumps(message))[:1000] or f"HTTP {status}"
    if status in (429, 503):
        return UpstreamError(BUSY, f"upstream engine busy: {message}", retry_after=_retry_after(headers))
    if status == 400 and (_CONTEXT_WORDS.search(message) or _CONTEXT_WORDS.search(code)):
        return UpstreamError(CONTEXT_LENGTH, message)
    if 400 <= status < 500:
        return UpstreamError(INVALID_REQUEST, f"upstream engine refused the request (HTTP {status}): {message}")
    return UpstreamError(UPSTREAM_ERROR, f"upstream engine failed at {url} (HTTP {status}): {message}")


def _retry_after(headers) -> float:
    try:
        return max(0.0, float(headers.get("retry-after")))
    except (TypeError, ValueError):
        return DEFAULT_RETRY_AFTER  # absent, or an HTTP date
