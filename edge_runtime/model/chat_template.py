"""Render chat messages into one prompt string with the model's Jinja template.

`ChatTemplate` takes `tokenizer.chat_template` from the GGUF and renders it
the way HuggingFace transformers' `apply_chat_template(..., tokenize=False)`
does: a sandboxed Jinja environment with trim_blocks/lstrip_blocks,
`raise_exception`, `strftime_now`, a `tojson` that keeps non-ASCII text, the
`{% generation %}` tag, transformers' guarded `dict`/`namespace`, and
`bos_token`/`eos_token` as variables; messages are normalised as transformers
5 does (None values dropped, reasoning fields aliased, inputs copied into plain
JSON types). A GGUF without a template gets ChatML. Any template failure (syntax error,
`raise_exception`, a type error inside the template) becomes an
`InvalidRequestError`.

It knows nothing about tokens: the result is text, to be tokenized with
`special=True` so the template's control tokens become single ids. It does not
validate message contents beyond their shape, nor pick named templates
(`tokenizer.chat_template.<name>`).
"""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from edge_runtime.errors import InvalidRequestError

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _raise_exception(message: str) -> None:
    import jinja2

    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # NOTE: transformers' tojson, not Jinja's: no HTML escaping, non-ASCII kept.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _generation_extension():
    """`{% generation %}...{% endgeneration %}` (transformers' AssistantTracker) rendered as its body."""
    from jinja2 import nodes
    from jinja2.ext import Extension

    class GenerationTag(Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

        def _render_body(self, caller):
            return caller()

    return GenerationTag


def _environment():
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_generation_extension(), jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _namespace_class()
    return env


class _TemplateDict:
    """`dict(...)` for templates without exposing the dict type itself."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


def _namespace_class():
    """Jinja's `namespace` that refuses underscore-prefixed attributes (as transformers)."""
    import jinja2.utils

    class TemplateNamespace(jinja2.utils.Namespace):
        def __init__(*args, **kwargs):  # Jinja's signature trick: `namespace(self=...)` still works
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"templates cannot set underscore attribute {name!r}")

    return TemplateNamespace


_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _plain(value: Any) -> Any:
    """Rebuild `value` from plain JSON types (as transformers does before rendering);
    anything else becomes an inert '<TypeName>' string the sandbox cannot misuse."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    for base in (str, int, float):  # subclasses (enums, ...) lose their extra methods
        if isinstance(value, base):
            return base(value) if base is not str else str.__str__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if type(value).__module__ == "numpy" and callable(getattr(value, "item", None)):
        return _plain(value.item())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):  # pydantic models
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _prepare_message(message: dict[str, Any]) -> dict[str, Any]:
    """transformers' normalisation: drop None values, alias reasoning fields, plain copies."""
    message = {k: _plain(v) for k, v in message.items() if v is not None}
    reasoning = next((message[k] for k in _REASONING_FIELDS if k in message), None)
    if reasoning is not None:
        message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
    return message


class ChatTemplate:
    """A compiled chat template plus the special-token strings it may reference."""

    def __init__(self, source: str | None, bos_token: str = "", eos_token: str = "",
                 extra_vars: dict[str, Any] | None = None):
        """Compile `source` (None or '' -> ChatML). Raises InvalidRequestError if it does not parse."""
        import jinja2

        self.is_fallback = not source
        self.source = CHATML_TEMPLATE if self.is_fallback else source
        self.bos_token = bos_token
        self.eos_token = eos_token
        self._vars = dict(extra_vars or {})
        try:
            self._template = _environment().from_string(self.source)
        except jinja2.TemplateSyntaxError as e:
            raise InvalidRequestError(f"chat template does not parse: {e.message} (template line {e.lineno})") from None

    @classmethod
    def from_metadata(cls, meta: dict[str, Any]) -> "ChatTemplate":
        """Build from GGUF metadata: `tokenizer.chat_template` and the bos/eos token texts."""
        tokens = meta.get("tokenizer.ggml.tokens") or []

        def token_text(key: str) -> str:
            tid = meta.get(key)
            return tokens[int(tid)] if tid is not None and 0 <= int(tid) < len(tokens) else ""

        extra = {name: text for name, key in (("unk_token", "unknown"), ("pad_token", "padding"))
                 if (text := token_text(f"tokenizer.ggml.{key}_token_id"))}
        return cls(
            meta.get("tokenizer.chat_template"),
            bos_token=token_text("tokenizer.ggml.bos_token_id"),
            eos_token=token_text("tokenizer.ggml.eos_token_id"),
            extra_vars=extra,
        )

    @classmethod
    def from_gguf(cls, path: str) -> "ChatTemplate":
        from edge_runtime.model.gguf_file import GGUFFile

        return cls.from_metadata(GGUFFile(path).metadata)

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **template_vars: Any) -> str:
        """Prompt text for `messages`.

        Args:
            messages: [{"role": "system"|"user"|"assistant"|..., "content": ...}, ...]
            add_generation_prompt: append the header that starts the assistant's turn.
            template_vars: extra variables, e.g. tools=[...], as transformers passes them.
        Returns:
            the rendered prompt, byte-for-byte what transformers renders.
        Raises:
            InvalidRequestError: malformed messages or any error raised while rendering.
        """
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise InvalidRequestError("messages must be a list of objects with 'role' and 'content'")
        if not messages:
            raise InvalidRequestError("messages must not be empty")
        for i, message in enumerate(messages):
            if not isinstance(message.get("role"), str):
                raise InvalidRequestError(f"messages[{i}] has no string 'role'")
        variables = {"bos_token": self.bos_token, "eos_token": self.eos_token, **self._vars}
        variables.update({k: _plain(v) for k, v in template_vars.items()})
        variables.setdefault("tools", None)
        variables.setdefault("documents", None)
        try:
            return self._template.render(
                messages=[_prepare_message(m) for m in messages],
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except Exception as e:  # the template is user/model-supplied code: any failure is a bad request
            raise InvalidRequestError(f"chat template failed to render: {type(e).__name__}: {e}") from None
