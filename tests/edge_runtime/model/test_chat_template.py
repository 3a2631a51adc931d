"""ChatTemplate: renders exactly what transformers' apply_chat_template renders.

Reference: transformers' `apply_chat_template(..., tokenize=False)` on a
tokenizer with the GGUF's special tokens (bos/eos/unk/pad), given each
template explicitly; the GGUF template is also checked against a hand-written
ChatML rendering. Loading transformers' tokenizer from the GGUF itself takes
~10 s, so that comparison runs only with EDGE_RUNTIME_SLOW_TESTS=1.
"""
from __future__ import annotations

import os

import pytest

from edge_runtime.model.chat_template import CHATML_TEMPLATE, ChatTemplate
from edge_runtime.errors import InvalidRequestError

SMOL_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

CONVERSATIONS = {
    "user_only": [{"role": "user", "content": "Hi there!"}],
    "system_user": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2+2?"},
    ],
    "multi_turn": [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another one, in 日本語 please 🎨"},
    ],
    "system_multi_turn": [
        {"role": "system", "content": "Answer in French.\nBe kind."},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Bonjour !"},
        {"role": "user", "content": "  spaces  and\ttabs\n"},
    ],
    "assistant_last": [
        {"role": "user", "content": "Continue:"},
        {"role": "assistant", "content": "Once upon a time"},
    ],
}

# content=None and reasoning fields: transformers drops None values and
# aliases reasoning_content/thinking/reasoning before rendering.
TOOL_CALL_CONVERSATION = [
    {"role": "user", "content": "Weather in Zürich?"},
    {"role": "assistant", "content": None, "reasoning": "Call the tool.",
     "tool_calls": [{"type": "function", "function": {"name": "météo", "arguments": {"city": "Zürich"}}}]},
    {"role": "tool", "content": "{\"temp\": 21}"},
]
TOOLS = [{"type": "function", "function": {"name": "météo", "description": "<b>weather</b> & more"}}]

# Small templates in the styles of popular models, exercising bos_token,
# raise_exception, tojson, loop controls, namespaces and {% generation %}.
OTHER_TEMPLATES = {
    "llama3": (
        "{{ bos_token }}{% for message in messages %}"
        "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
    ),
    "alternating": (
        "{% for message in messages %}\n"
        "  {% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}\n"
        "    {{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}\n"
        "  {% endif %}\n"
        "  {{ '<start_of_turn>' + message['role'] + '\n' + message['content'] + '<end_of_turn>\n' }}\n"
        "{% endfor %}\n"
        "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
    ),
    "tools_json": (
        "{% set ns = namespace(n=0) %}{% if tools %}{{ 'Tools: ' + (tools | tojson) + '\n' }}{% endif %}"
        "{% for m in messages %}{% set ns.n = ns.n + 1 %}{% if m['role'] == 'system' %}{% continue %}{% endif %}"
        "{{ ns.n ~ '|' ~ (m | tojson(indent=2)) ~ eos_token }}{% endfor %}"
    ),
    "reasoning_dict": (
        "{% for m in messages %}{{ m.get('reasoning_content', '-') }}:{{ dict(role=m['role']) | tojson }}"
        "{{ '\n' if not loop.last }}{% endfor %}"
    ),
    "generation_tag": (
        "{% for m in messages %}{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}{% endgeneration %}"
        "{% else %}{{ m['role'] }}: {{ m['content'] }}\n{% endif %}{% endfor %}"
    ),
}


def _smol_expected(messages: list[dict], add_generation_prompt: bool) -> str:
    """SmolLM2's template written out by hand: ChatML with a default system prompt."""
    out = []
    if messages[0]["role"] != "system":
        out.append(f"<|im_start|>system\n{SMOL_SYSTEM}<|im_end|>\n")
    out += [f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages]
    if add_generation_prompt:
        out.append("<|im_start|>assistant\n")
    return "".join(out)


@pytest.fixture(scope="module")
def template(model_path) -> ChatTemplate:
    return ChatTemplate.from_gguf(model_path)


@pytest.fixture(scope="module")
def hf_tokenizer(template):
    """A transformers tokenizer with the GGUF's special tokens (what its GGUF loader sets)."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models

    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.BPE()),
        bos_token=template.bos_token,
        eos_token=template.eos_token,
        unk_token="<|endoftext|>",
        pad_token=template.eos_token,
    )


def _hf_render(hf_tokenizer, source: str, messages, add_generation_prompt: bool, **kwargs) -> str:
    return hf_tokenizer.apply_chat_template(
        messages, chat_template=source, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
    )


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_gguf_template_matches_transformers(template, hf_tokenizer, name, add_generation_prompt):
    messages = CONVERSATIONS[name]
    ours = template.render(messages, add_generation_prompt=add_generation_prompt)
    assert not template.is_fallback
    assert ours == _smol_expected(messages, add_generation_prompt)
    assert ours == _hf_render(hf_tokenizer, template.source, messages, add_generation_prompt)


def test_gguf_special_tokens(template):
    assert (template.bos_token, template.eos_token) == ("<|im_start|>", "<|im_end|>")


@pytest.mark.skipif(not os.environ.get("EDGE_RUNTIME_SLOW_TESTS"), reason="set EDGE_RUNTIME_SLOW_TESTS=1 (~10 s)")
def test_gguf_template_matches_transformers_gguf_loader(model_path, template):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(os.path.dirname(model_path), gguf_file=os.path.basename(model_path))
    for messages in CONVERSATIONS.values():
        for add_generation_prompt in (True, False):
            theirs = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
            assert template.render(messages, add_generation_prompt=add_generation_prompt) == theirs


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("name", sorted(OTHER_TEMPLATES))
def test_other_templates_match_transformers(hf_tokenizer, name, add_generation_prompt):
    source = OTHER_TEMPLATES[name]
    ours = ChatTemplate(source, bos_token=hf_tokenizer.bos_token, eos_token=hf_tokenizer.eos_token,
                        extra_vars={"unk_token": hf_tokenizer.unk_token, "pad_token": hf_tokenizer.pad_token})
    for messages in list(CONVERSATIONS.values()) + [TOOL_CALL_CONVERSATION]:
        kwargs = {"tools": TOOLS} if name == "tools_json" else {}
        try:
            theirs = _hf_render(hf_tokenizer, source, messages, add_generation_prompt, **kwargs)
        except Exception as e:  # the template refuses this conversation: so must we, saying why
            with pytest.raises(InvalidRequestError) as raised:
                ours.render(messages, add_generation_prompt=add_generation_prompt, **kwargs)
            assert str(e) in str(raised.value)
            continue
        assert ours.render(messages, add_generation_prompt=add_generation_prompt, **kwargs) == theirs


def test_no_template_falls_back_to_chatml():
    meta = {"tokenizer.ggml.tokens": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], "tokenizer.ggml.eos_token_id": 2}
    template = ChatTemplate.from_metadata(meta)
    assert template.is_fallback and template.source == CHATML_TEMPLATE
    messages = CONVERSATIONS["system_multi_turn"]
    expected = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    assert template.render(messages) == expected + "<|im_start|>assistant\n"
    assert template.render(messages, add_generation_prompt=False) == expected


def test_template_helpers():
    source = "{{ strftime_now('%Y') | length }}|{{ messages | tojson }}|{{ bos_token }}{{ eos_token }}"
    out = ChatTemplate(source, bos_token="<s>", eos_token="</s>").render([{"role": "user", "content": "é<&>"}])
    assert out == '4|[{"role": "user", "content": "é<&>"}]|<s></s>'


@pytest.mark.parametrize(
    "source, messages, match",
    [
        ("{% for m in messages %}{{ m['content'] }", [{"role": "user", "content": "x"}], "does not parse"),
        ("{% if %}", [{"role": "user", "content": "x"}], "does not parse"),
        ("{{ raise_exception('System role not supported') }}", [{"role": "user", "content": "x"}], "not supported"),
        ("{{ messages[0]['content'] + 1 }}", [{"role": "user", "content": "x"}], "TypeError"),
        ("{{ messages.__class__.__mro__ }}", [{"role": "user", "content": "x"}], "SecurityError|unsafe"),
        ("{{ messages.append(1) }}", [{"role": "user", "content": "x"}], "SecurityError|unsafe"),
        ("{% set ns = namespace(_x=1) %}{{ ns }}", [{"role": "user", "content": "x"}], "underscore"),
    ],
)
def test_broken_templates_raise_invalid_request(source, messages, match):
    with pytest.raises(InvalidRequestError, match=match):
        ChatTemplate(source).render(messages)


@pytest.mark.parametrize("messages", ["hi", [], [["user", "hi"]], [{"content": "no role"}], [{"role": 3, "content": "x"}]])
def test_malformed_messages_raise_invalid_request(messages):
    with pytest.raises(InvalidRequestError):
        ChatTemplate(None).render(messages)
