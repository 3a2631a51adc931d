"""Text <-> token ids for byte-level BPE vocabularies stored in a GGUF file.

`Tokenizer` rebuilds the tokenizer that llama.cpp would build from the GGUF
metadata (`tokenizer.ggml.*`) and produces the same ids:

* special tokens (CONTROL, USER_DEFINED, UNKNOWN) are cut out of the text
  first, longest first, exactly like llama.cpp's `tokenizer_st_partition`;
  with `special=False` CONTROL/UNKNOWN tokens are plain text, but
  USER_DEFINED tokens are still matched (llama.cpp and HF both do that);
* the remaining text goes through the pre-tokenizer regexes llama.cpp uses for
  the file's `tokenizer.ggml.pre`, the GPT-2 byte-to-unicode map and BPE
  merges, run by the HuggingFace `tokenizers` library.

It supports only `tokenizer.ggml.model == "gpt2"` (byte-level BPE) with the
pre-tokenizers in `PRE_TOKENIZERS`; SentencePiece (`llama`, e.g. Gemma),
WordPiece and the rest raise `UnsupportedModelError`. It knows nothing about
chat templates, models or sampling. It does not reproduce llama.cpp's
per-model-name token attributes (lstrip/rstrip for phi-3, jina, ...) nor its
gpt-oss/gemma4 end-of-generation workarounds (their tokenizers are unsupported).
"""
from __future__ import annotations

import functools

from typing import Any, Iterable, Sequence

from edge_runtime.errors import InvalidRequestError, ModelFileError, UnsupportedModelError

# GGUF `tokenizer.ggml.token_type` values (llama.cpp `llama_token_type`).
TOKEN_TYPE_UNDEFINED = 0
TOKEN_TYPE_NORMAL = 1
TOKEN_TYPE_UNKNOWN = 2
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4
TOKEN_TYPE_UNUSED = 5
TOKEN_TYPE_BYTE = 6

# Pre-tokenizer regexes, verbatim from llama.cpp src/llama-vocab.cpp. llama.cpp
# applies them one after another, each to the pieces the previous one made;
# text a regex does not match stays a piece of its own (HF "isolated").
# NOTE: GPT-2's regex has `|\s+` appended: llama.cpp's own gpt2 splitter
# implements it, and for isolated splitting it changes nothing.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_LLAMA3 = (
    _CONTRACTIONS
    + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"

# tokenizer.ggml.pre -> (regexes, ignore_merges). ignore_merges: a piece that
# is already a vocab entry becomes that token without running the merges.
_FAMILIES = [
    (("gpt2", "gpt-2", "phi-2", "mpt", "olmo"), (_GPT2,), False),
    (("smollm", "starcoder", "refact", "command-r", "codeshell"), (r"\p{N}", _GPT2), False),
    (("llama3", "llama-v3", "llama-bpe", "falcon3"), (_LLAMA3,), True),
    (("qwen2", "deepseek-r1-qwen", "stablelm2", "megrez"), (_QWEN2,), False),
]
PRE_TOKENIZERS: dict[str, tuple[tuple[str, ...], bool]] = {
    name: (regexes, ignore) for names, regexes, ignore in _FAMILIES for name in names
}

# Token texts llama.cpp treats as end-of-generation, from
# `llama_vocab::impl::load`; it also forces them to CONTROL.
_EOG_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<\uff5cend\u2581of\u2581sentence\uff5c>", "[e~[",
})
# Special-token roles llama.cpp finds by text when the GGUF has no
# `tokenizer.ggml.<role>_token_id` (first match wins), forcing them to CONTROL;
# eot/eom/fim_pad/fim_rep/fim_sep also end generation. role -> texts.
_ROLE_TEXTS: dict[str, tuple[str, ...]] = {
    "eot": ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>",
            "<EOT>", "_<EOT>", "[EOT]", "<\uff5cend\u2581of\u2581sentence\uff5c>", "<end_of_utterance>"),
    "eom": ("<|eom_id|>",),
    "fim_pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<\uff5cfim\u2581begin\uff5c>", "<PRE>",
                "\u2581<PRE>", "<|code_prefix|>", "<|prefix|>"),
    "fim_suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<\uff5cfim\u2581hole\uff5c>", "<SUF>",
                "\u2581<SUF>", "<|code_suffix|>", "<|suffix|>"),
    "fim_mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<\uff5cfim\u2581end\uff5c>", "<MID>",
                "\u2581<MID>", "<|code_middle|>", "<|middle|>"),
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}
_EOG_ROLES = ("eot", "eom", "fim_pad", "fim_rep", "fim_sep")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map."""
    keep = list(range(0x21, 0x7F)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    table = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


_BYTE_TO_CHAR = _bytes_to_unicode()
_CHAR_TO_BYTE = {c: b for b, c in _BYTE_TO_CHAR.items()}
_TO_LATIN1 = {ord(c): b for c, b in _CHAR_TO_BYTE.items()}


def _normal_token_bytes(text: str) -> bytes:
    """Undo the byte-to-unicode map; a char outside the map keeps its UTF-8."""
    try:
        return text.translate(_TO_LATIN1).encode("latin-1")
    except UnicodeEncodeError:
        return b"".join(bytes([_CHAR_TO_BYTE[c]]) if c in _CHAR_TO_BYTE else c.encode("utf-8") for c in text)


class Tokenizer:
    """Byte-level BPE tokenizer that matches llama.cpp's ids for the same GGUF."""

    def __init__(
        self,
        tokens: Sequence[str],
        token_types: Sequence[int],
        merges: Sequence[str],
        pre: str,
        bos_id: int | None = None,
        eos_id: int | None = None,
        add_bos_token: bool = False,
        role_ids: dict[str, int] | None = None,
    ):
        """Low-level constructor; most callers want `from_gguf` / `from_metadata`.

        Args:
            tokens, token_types, merges: `tokenizer.ggml.{tokens,token_type,merges}`.
            pre: `tokenizer.ggml.pre`, a key of `PRE_TOKENIZERS`.
            role_ids: ids the GGUF names for eot/eom/fim_* (see `_ROLE_TEXTS`);
                roles left out are found by token text, as llama.cpp does.
        """
        if pre not in PRE_TOKENIZERS:
            raise UnsupportedModelError(
                f"unsupported pre-tokenizer {pre!r} (tokenizer.ggml.pre); supported: "
                + ", ".join(sorted(PRE_TOKENIZERS))
            )
        if len(token_types) < len(tokens):
            raise ModelFileError(f"tokenizer.ggml.token_type has {len(token_types)} entries for {len(tokens)} tokens")
        self.pre = pre
        self._tokens = list(tokens)
        self._types = [int(t) for t in token_types[: len(tokens)]]
        self._token_to_id = {t: i for i, t in enumerate(self._tokens)}
        num_tokens = len(self._tokens)
        self._bos_id = bos_id if bos_id is not None and 0 <= bos_id < num_tokens else None
        self._eos_id = eos_id if eos_id is not None and 0 <= eos_id < num_tokens else None
        self.add_bos_token = bool(add_bos_token) and self._bos_id is not None
        self._eog_ids = frozenset(self._resolve_roles(dict(role_ids or {})))

        special_types = (TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED, TOKEN_TYPE_UNKNOWN)
        specials = [i for i, t in enumerate(self._types) if t in special_types]
        specials.sort(key=lambda i: -len(self._tokens[i].encode("utf-8")))  # stable: ties by id
        # (text, id, is_control_or_unknown)
        self._specials = [(self._tokens[i], i, self._types[i] != TOKEN_TYPE_USER_DEFINED) for i in specials]
        self._hidden = [t in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_UNKNOWN) for t in self._types]
        self._bytes = [self._piece(i) for i in range(num_tokens)]

        regexes, ignore_merges = PRE_TOKENIZERS[pre]
        self._bpe = self._build_bpe(merges, regexes, ignore_merges)

    def _resolve_roles(self, role_ids: dict[str, int]) -> set[int]:
        """Apply llama.cpp's text-based special-token fixups; return the EOG ids."""
        num_tokens = len(self._tokens)
        forced: set[int] = set()
        for role, texts in _ROLE_TEXTS.items():
            if role not in role_ids:
                found = next((self._token_to_id[t] for t in texts if t in self._token_to_id), None)
                if found is not None:
                    role_ids[role] = found
                    forced.add(found)
        eog = {role_ids[r] for r in _EOG_ROLES if r in role_ids}
        named = {self._token_to_id[t] for t in _EOG_TEXTS if t in self._token_to_id}
        forced |= named
        eog |= named
        if self._eos_id is not None:
            eog.add(self._eos_id)
        for tid in forced:
            if self._types[tid] not in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_UNKNOWN):
                # NOTE: llama.cpp ORs in CONTROL; CONTROL wins over USER_DEFINED everywhere we look.
                self._types[tid] = TOKEN_TYPE_CONTROL
        return {i for i in eog if 0 <= i < num_tokens}

    # --- construction ---------------------------------------------------

    @classmethod
    def from_metadata(cls, meta: dict[str, Any]) -> "Tokenizer":
        """Build from GGUF metadata (`GGUFFile(path).metadata`)."""
        model = meta.get("tokenizer.ggml.model")
        if model is None:
            raise ModelFileError("GGUF metadata has no tokenizer.ggml.model")
        if model != "gpt2":
            hint = " (SentencePiece: Gemma, Llama 1/2, Mistral)" if model == "llama" else ""
            raise UnsupportedModelError(
                f"unsupported tokenizer model {model!r}{hint}; only byte-level BPE ('gpt2') is supported"
            )
        for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"):
            if key not in meta:
                raise ModelFileError(f"GGUF metadata lacks {key}")
        tokens = meta["tokenizer.ggml.tokens"]
        types = meta.get("tokenizer.ggml.token_type") or [TOKEN_TYPE_NORMAL] * len(tokens)
        pre = meta.get("tokenizer.ggml.pre")
        if not pre:
            raise UnsupportedModelError("GGUF has no tokenizer.ggml.pre; llama.cpp's 'default' pre-tokenizer is unsupported")
        role_ids = {}
        for role in _ROLE_TEXTS:
            value = meta.get(f"tokenizer.ggml.{role}_token_id")
            if value is not None and 0 <= int(value) < len(tokens):
                role_ids[role] = int(value)

        def opt_int(key: str) -> int | None:
            value = meta.get(key)
            return None if value is None else int(value)

        return cls(
            tokens,
            types,
            meta["tokenizer.ggml.merges"],
            pre,
            bos_id=opt_int("tokenizer.ggml.bos_token_id"),
            eos_id=opt_int("tokenizer.ggml.eos_token_id"),
            add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
            role_ids=role_ids,
        )

    @classmethod
    def from_gguf(cls, path: str) -> "Tokenizer":
        from edge_runtime.model.gguf_file import GGUFFile

        return cls.from_metadata(GGUFFile(path).metadata)

    def _build_bpe(self, merges: Sequence[str], regexes: Sequence[str], ignore_merges: bool):
        from tokenizers import Regex
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import decoders, models, pre_tokenizers

        vocab = self._token_to_id
        pairs = []
        for merge in merges:
            pos = merge.find(" ", 1)  # llama.cpp splits at the first space after position 0
            if pos < 0:
                continue
            left, right = merge[:pos], merge[pos + 1:]
            # NOTE: HF refuses merges whose parts or result are not in the vocab
            # (llama.cpp would apply them, then drop the unknown piece); none in
            # well-formed vocabularies, so that is the only place the two differ.
            if left in vocab and right in vocab and left + right in vocab:
                pairs.append((left, right))
        bpe = models.BPE(vocab=dict(vocab), merges=pairs, ignore_merges=ignore_merges, fuse_unk=False)
        hf = HFTokenizer(bpe)
        splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes]
        hf.pre_tokenizer = pre_tokenizers.Sequence(
            splits + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
        hf.decoder = decoders.ByteLevel()
        return hf

    def _piece(self, tid: int) -> bytes:
        """What llama.cpp's token_to_piece(special=True) yields for a token."""
        kind = self._types[tid]
        text = self._tokens[tid]
        if kind in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_UNKNOWN, TOKEN_TYPE_USER_DEFINED):
            return text.encode("utf-8")
        if kind == TOKEN_TYPE_NORMAL:
            return _normal_token_bytes(text)
        if kind == TOKEN_TYPE_BYTE and len(text) == 6 and text.startswith("<0x"):
            return bytes([int(text[3:5], 16)])
        return b""  # UNUSED / UNDEFINED render as nothing

    # --- encode / decode --------------------------------------------------

    def _partition(self, text: str, special: bool) -> list[str | int]:
        """Split text into raw-text pieces and special token ids (llama.cpp order)."""
        fragments: list[str | int] = [text]
        for token_text, tid, hidden in self._specials:
            if (hidden and not special) or token_text not in text:
                continue
            out: list[str | int] = []
            for fragment in fragments:
                if isinstance(fragment, int) or token_text not in fragment:
                    out.append(fragment)
                    continue
                for k, part in enumerate(fragment.split(token_text)):
                    if k:
                        out.append(tid)
                    if part:
                        out.append(part)
            fragments = out
        return fragments

    def encode(self, text: str, special: bool = True, add_bos: bool = False) -> list[int]:
        """Token ids for `text`.

        Args:
            special: match CONTROL tokens written in the text (e.g. '<|im_start|>')
                as single tokens; False tokenizes them as plain text.
            add_bos: prepend BOS, but only if the GGUF says add_bos_token=true.
        Returns:
            list of token ids, identical to llama.cpp's `llama_tokenize`.
        """
        if not isinstance(text, str):
            raise InvalidRequestError(f"text to tokenize must be str, not {type(text).__name__}")
        ids: list[int] = []
        if add_bos and self.add_bos_token:
            ids.append(self._bos_id)  # type: ignore[arg-type]
        if not text:
            return ids
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:  # lone surrogates (e.g. from JSON "\ud800"): pair them up or make them U+FFFD
            text = text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
        fragments = self._partition(text, special) if self._specials else [text]
        for fragment in fragments:
            if isinstance(fragment, int):
                ids.append(fragment)
            else:
                ids.extend(self._bpe.encode(fragment, add_special_tokens=False).ids)
        return ids

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """Text for `ids`; invalid UTF-8 becomes U+FFFD. skip_special drops CONTROL tokens."""
        ids = list(ids)
        self._check_ids(ids)
        table, hidden = self._bytes, self._hidden
        if skip_special:
            data = b"".join(table[i] for i in ids if not hidden[i])
        else:
            data = b"".join(table[i] for i in ids)
        return data.decode("utf-8", errors="replace")

    def token_bytes(self, tid: int) -> bytes:
        """Raw bytes one token stands for (special tokens: their text). O(1)."""
        if not 0 <= tid < len(self._bytes):
            raise InvalidRequestError(f"token id {tid} out of range [0, {len(self._bytes)})")
        return self._bytes[tid]

    def _check_ids(self, ids: list[int]) -> None:
        if ids and (min(ids) < 0 or max(ids) >= len(self._tokens)):
            bad = next(i for i in ids if not 0 <= i < len(self._tokens))
            raise InvalidRequestError(f"token id {bad} out of range [0, {len(self._tokens)})")

    # --- vocabulary ------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return len(self._tokens)

    @functools.cached_property
    def fingerprint(self) -> str:
        """Equal for two tokenizers whose ids name the same tokens: token ids can pass between them. A hash over
        the whole vocabulary (about 20 ms for 49k tokens), made once: the vocabulary never changes."""
        return vocab_fingerprint(self._tokens)

    @property
    def bos_id(self) -> int | None:
        return self._bos_id

    @property
    def eos_id(self) -> int | None:
        return self._eos_id

    @property
    def eog_ids(self) -> frozenset[int]:
        """Ids that end generation: eos, eot, eom, '<|im_end|>', '<|endoftext|>', ... (as llama.cpp)."""
        return self._eog_ids

    def token_to_id(self, token: str) -> int | None:
        """Id of a vocab entry (raw vocab spelling, e.g. 'Ġthe'), or None."""
        return self._token_to_id.get(token)

    def id_to_token(self, tid: int) -> str:
        """Raw vocab entry for an id (e.g. 'Ġthe', '<|im_end|>')."""
        if not 0 <= tid < len(self._tokens):
            raise InvalidRequestError(f"token id {tid} out of range [0, {len(self._tokens)})")
        return self._tokens[tid]

    def is_special(self, tid: int) -> bool:
        """True for CONTROL/UNKNOWN tokens (the ones `skip_special` drops)."""
        return self._hidden[tid]


def vocab_fingerprint(tokens) -> str:
    import hashlib

    h = hashlib.sha256()
    for t in tokens:
        h.update(t.encode("utf-8", "surrogatepass") + b"\x00")
    return h.hexdigest()[:16]
