"""Build an in-memory `tokenizers.Tokenizer` from GGUF tokenizer metadata.

GGUF stores the vocabulary under llama.cpp's key names (`tokenizer.ggml.*`) instead of a
`tokenizer.json`. Two vocabulary kinds are supported:

- `gpt2`: byte-level BPE from tokens + merges; the split regex is picked from `tokenizer.ggml.pre`
  the way llama.cpp does.
- `llama`: SentencePiece-style BPE with byte fallback; merges are recovered from the scores,
  as transformers' GGUF converter does.
"""

from dataclasses import dataclass
from typing import Any

import numpy as np
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from mlxformer.errors import MlxformerError

# llama.cpp token types (llama_token_type).
CONTROL = 3
USER_DEFINED = 4

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# `tokenizer.ggml.pre` -> custom split regex (llama.cpp's llama-vocab.cpp groups these names).
_SPLIT_REGEX: dict[str, str] = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral", "dbrx", "smaug-bpe"), _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "stablelm2"), _QWEN2_SPLIT),
    **dict.fromkeys(("gpt-4o", "llama4"), _GPT4O_SPLIT),
}
# Pre-tokenizers that isolate every digit before the GPT-2 regex (llama.cpp: "\p{N}" first;
# HF's own SmolLM/StarCoder tokenizer.json: Digits(individual_digits=True) + ByteLevel).
_DIGIT_SPLIT = frozenset(("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"))


_SPECIAL_IDS = {
    "bos_token": "bos_token_id",
    "eos_token": "eos_token_id",
    "unk_token": "unknown_token_id",
    "pad_token": "padding_token_id",
    "eot_token": "eot_token_id",
    "eom_token": "eom_token_id",
}
_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")


@dataclass(frozen=True)
class GGUFVocab:
    """A tokenizer built from GGUF metadata plus the settings that live outside `tokenizer.json`."""

    tokenizer: HFTokenizer
    bos_token_id: int | None
    eos_token_ids: list[int]
    add_bos_token: bool
    add_eos_token: bool
    special_tokens: dict[str, str]  # bos_token / eos_token / unk_token / pad_token -> token text
    chat_template: str | None


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, (chr(c) for c in chars)))


def _scalar(metadata: dict[str, Any], key: str) -> Any:
    """A scalar metadata value as a Python object, or None when absent."""
    value = metadata.get(key)
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return np.asarray(value).item()


def _array(metadata: dict[str, Any], key: str) -> list | None:
    value = metadata.get(key)
    if value is None:
        return None
    if isinstance(value, list):
        return value
    return np.asarray(value).tolist()


def _byte_level_model(tokens: list[str], merges: list[str] | None) -> tuple[HFTokenizer, set[str]]:
    alphabet = set(bytes_to_unicode().values())
    spell = bytes_to_unicode()
    vocab = {
        tok if set(tok) <= alphabet else "".join(spell[b] for b in tok.encode("utf-8")): i
        for i, tok in enumerate(tokens)
    }
    if merges is None:
        raise MlxformerError("GGUF byte-level (gpt2) tokenizer has no tokenizer.ggml.merges")
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    model = models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False)
    return HFTokenizer(model), alphabet


def _byte_level_pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _SPLIT_REGEX:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_SPLIT_REGEX[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    if pre in _DIGIT_SPLIT:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    return byte_level


def spm_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """BPE merges implied by a SentencePiece vocabulary: every split of a piece into two pieces, best score first."""
    vocab = {tok: i for i, tok in enumerate(tokens)}
    merges: list[tuple[str, str, float]] = []
    for piece, score in zip(tokens, scores):
        local = [
            (piece[:k], piece[k:], score)
            for k in range(1, len(piece))
            if piece[:k] in vocab and piece[k:] in vocab
        ]
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        merges.extend(local)
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def _spm_model(tokens: list[str], scores: list[float] | None, add_prefix_space: bool) -> HFTokenizer:
    if scores is None:
        raise MlxformerError("GGUF SentencePiece (llama) tokenizer has no tokenizer.ggml.scores")
    vocab = {tok: i for i, tok in enumerate(tokens)}
    model = models.BPE(vocab=vocab, merges=spm_merges(tokens, scores), fuse_unk=True, byte_fallback=True)
    tok = HFTokenizer(model)
    tok.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if add_prefix_space else "never", split=False
    )
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix_space:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    tok.decoder = decoders.Sequence(steps)
    return tok


def _add_typed_tokens(
    tok: HFTokenizer, tokens: list[str], token_type: list[int] | None, alphabet: set[str] | None
) -> None:
    """Control tokens become special added tokens, user-defined ones plain added tokens (never split)."""
    if token_type is None:
        return
    control = [
        AddedToken(t, normalized=False, special=True)
        for t, kind in zip(tokens, token_type)
        if kind == CONTROL and (alphabet is None or set(t) <= alphabet)
    ]
    tok.add_special_tokens(control)
    vocab = tok.get_vocab(with_added_tokens=False)
    user = [
        AddedToken(t, normalized=False, special=False)
        for t, kind in zip(tokens, token_type)
        if kind == USER_DEFINED and t in vocab
    ]
    tok.add_tokens(user)


def build_gguf_vocab(metadata: dict[str, Any]) -> GGUFVocab:
    """Build the tokenizer described by `mx.load(path, return_metadata=True)[1]`."""
    kind = _scalar(metadata, "tokenizer.ggml.model")
    tokens = _array(metadata, "tokenizer.ggml.tokens")
    if kind is None or tokens is None:
        raise MlxformerError("GGUF file has no tokenizer (missing tokenizer.ggml.model / tokenizer.ggml.tokens)")
    token_type = _array(metadata, "tokenizer.ggml.token_type")
    alphabet: set[str] | None = None
    if kind == "gpt2":
        tok, alphabet = _byte_level_model(tokens, _array(metadata, "tokenizer.ggml.merges"))
        tok.pre_tokenizer = _byte_level_pre_tokenizer(_scalar(metadata, "tokenizer.ggml.pre"))
        tok.decoder = decoders.ByteLevel()
        default_bos = False
    elif kind == "llama":
        prefix = _scalar(metadata, "tokenizer.ggml.add_space_prefix")
        tok = _spm_model(tokens, _array(metadata, "tokenizer.ggml.scores"), True if prefix is None else bool(prefix))
        default_bos = True  # llama.cpp adds BOS to a SentencePiece vocabulary that does not say otherwise
    else:
        raise MlxformerError(f"unsupported GGUF tokenizer model {kind!r} (supported: 'gpt2', 'llama')")
    _add_typed_tokens(tok, tokens, token_type, alphabet)

    def token_id(key: str) -> int | None:
        value = _scalar(metadata, f"tokenizer.ggml.{key}")
        if value is None:
            return None
        if not 0 <= int(value) < len(tokens):
            raise MlxformerError(f"GGUF tokenizer.ggml.{key}={value} is outside the vocabulary of {len(tokens)}")
        return int(value)

    ids = {name: token_id(key) for name, key in _SPECIAL_IDS.items()}
    special = {name: tokens[i] for name, i in ids.items() if i is not None and name in _SPECIAL_NAMES}
    # transformers registers bos/eos/unk/pad as special tokens too, so they match whole in text.
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in special.values()])
    eos_ids = list(dict.fromkeys(i for name in ("eos_token", "eot_token", "eom_token") if (i := ids[name]) is not None))
    add_bos = _scalar(metadata, "tokenizer.ggml.add_bos_token")
    add_eos = _scalar(metadata, "tokenizer.ggml.add_eos_token")
    return GGUFVocab(
        tokenizer=tok,
        bos_token_id=ids["bos_token"],
        eos_token_ids=eos_ids,
        add_bos_token=default_bos if add_bos is None else bool(add_bos),
        add_eos_token=bool(add_eos),
        special_tokens=special,
        chat_template=_scalar(metadata, "tokenizer.chat_template"),
    )

