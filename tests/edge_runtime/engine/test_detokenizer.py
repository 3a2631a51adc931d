"""IncrementalDetokenizer: streamed text never breaks a character and adds up exactly."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edge_runtime.engine.detokenizer import IncrementalDetokenizer
from edge_runtime.errors import ModelFileError


def _stream(pieces: list[bytes]) -> tuple[list[str], str]:
    """Push pieces as tokens 0..n-1; return the per-push outputs and the flush."""
    detok = IncrementalDetokenizer(lambda i: pieces[i])
    outputs = [detok.push(i) for i in range(len(pieces))]
    return outputs, detok.flush()


def test_emoji_split_across_three_tokens():
    outputs, rest = _stream([b"a\xf0", b"\x9f\x98", b"\x80b"])
    assert outputs == ["a", "", "\U0001f600b"]
    assert rest == ""


def test_cjk_split_byte_by_byte():
    data = "你好".encode("utf-8")
    outputs, rest = _stream([bytes([b]) for b in data])
    assert outputs == ["", "", "你", "", "", "好"]
    assert rest == ""


def test_invalid_bytes_become_replacement_only_when_certain():
    detok = IncrementalDetokenizer(lambda i: [b"\xf0\x9f", b"A", b"\xff", b"\xe4\xbd"][i])
    assert detok.push(0) == ""  # may still become an emoji
    assert detok.num_pending_bytes == 2
    assert detok.push(1) == "\ufffdA"  # 'A' proves it never will
    assert detok.push(2) == "\ufffd"  # 0xFF can never start a character
    assert detok.push(3) == ""
    assert detok.flush() == "\ufffd"  # end of stream: incomplete -> one U+FFFD
    assert detok.flush() == ""
    assert detok.num_tokens == 4


def test_push_many_equals_pushes():
    pieces = [b"x\xe2", b"\x82", b"\xac", b"\xf0\x9f\x91", b"\x8d!"]
    one = IncrementalDetokenizer(lambda i: pieces[i])
    assert one.push_many([0, 1, 2, 3, 4]) + one.flush() == "x\u20ac\U0001f44d!"


@settings(max_examples=200, deadline=None)
@given(st.text(), st.lists(st.integers(min_value=0), max_size=12))
def test_valid_text_split_anywhere(text, cuts):
    data = text.encode("utf-8", errors="surrogatepass")
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:  # lone surrogates are not valid text
        return
    bounds = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
    pieces = [data[a:b] for a, b in zip(bounds, bounds[1:])]
    outputs, rest = _stream(pieces)
    assert "".join(outputs) + rest == text
    assert all("\ufffd" not in out for out in outputs) or "\ufffd" in text


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=40), st.lists(st.integers(min_value=0), max_size=12))
def test_any_bytes_match_one_shot_decode(data, cuts):
    bounds = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
    outputs, rest = _stream([data[a:b] for a, b in zip(bounds, bounds[1:])])
    assert "".join(outputs) + rest == data.decode("utf-8", errors="replace")


# --- real tokens from the default model -------------------------------------


@pytest.fixture(scope="module")
def tok():
    from edge_runtime.model.path import default_model_path
    from edge_runtime.model.tokenizer import Tokenizer

    try:
        return Tokenizer.from_gguf(default_model_path())
    except ModelFileError as e:
        pytest.skip(str(e))


@pytest.mark.parametrize("text", ["🦙🦙 llama", "👨‍👩‍👧‍👦 family", "繁體與简体：龘靐齉", "日本語のテキスト", "한국어 텍스트", "𝕏 𠀀"])
def test_real_tokens_that_split_characters(tok, text):
    ids = tok.encode(text)
    partial = [i for i in ids if _is_partial(tok.token_bytes(i))]
    assert partial, "expected some tokens that are not whole UTF-8 characters"
    detok = IncrementalDetokenizer(tok.token_bytes)
    outputs = [detok.push(i) for i in ids]
    assert all("\ufffd" not in out for out in outputs)
    assert "".join(outputs) + detok.flush() == text


def _is_partial(piece: bytes) -> bool:
    try:
        piece.decode("utf-8")
        return False
    except UnicodeDecodeError:
        return True
