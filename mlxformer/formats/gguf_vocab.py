"""Build an in-memory `tokenizers.Tokenizer` from GGUF tokenizer metadata.

GGUF stores the vocabulary under llama.cpp's key names (`tokenizer.ggml.*`) instead of a
`tokenizer.json`. Two vocabulary kinds are supported:

- `gpt2`: byte-level BPE from tokens + merges; the split regex and `ignore_merges` are picked
  from `tokenizer.ggml.pre` the way llama.cpp does. Control and user-defined tokens are stored
  as their text (`<｜User｜>`), not in the byte alphabet, and keep their ids.
- `llama`: SentencePiece-style BPE with byte fallback; merges are recovered from the scores,
  as transformers' GGUF converter does.

Every value is type-checked first: an ill-typed one is a one-line error naming the file and key.
"""

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
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
# Pre-tokenizers llama.cpp (llama-vocab.cpp) runs with ``ignore_merges`` (a pre-token that is
# itself in the vocabulary is one token, as HF's Llama-3 tokenizer.json says too) and for which
# it adds a BOS when the file has no tokenizer.ggml.add_bos_token.
_IGNORE_MERGES = frozenset(("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral"))
_BOS_BY_DEFAULT = _IGNORE_MERGES


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


class _Metadata:
    """Typed reads of GGUF metadata values (``mx.load``'s arrays or the reader's numpy/Python
    values); an ill-typed value raises one line naming the file and the key."""

    def __init__(self, metadata: dict[str, Any], source: str) -> None:
        self.metadata, self.source = metadata, source

    def fail(self, key: str, message: str) -> None:
        raise MlxformerError(f"{self.source}: {key} {message}")

    def scalar(self, key: str, kind: type | tuple[type, ...]) -> Any:
        """A single value of Python type ``kind`` (int, bool, str), or None when absent."""
        value = self.metadata.get(key)
        if value is None:
            return None
        if isinstance(value, (mx.array, np.ndarray, np.generic)):
            if value.ndim != 0:
                self.fail(key, f"must be a single value, got an array of shape {tuple(value.shape)}")
            value = value.item()
        elif isinstance(value, (list, tuple)):
            self.fail(key, f"must be a single value, got a list of {len(value)}")
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if int in kinds and bool not in kinds and isinstance(value, bool):
            self.fail(key, f"must be an integer, got {value!r}")
        if not isinstance(value, kinds):
            self.fail(key, f"must be {' or '.join(k.__name__ for k in kinds)}, got {type(value).__name__} {value!r:.40}")
        return value

    def strings(self, key: str) -> list[str] | None:
        """An array of non-empty strings, or None when absent."""
        value = self.metadata.get(key)
        if value is None:
            return None
        if not isinstance(value, list):
            self.fail(key, f"must be an array of strings, got {type(value).__name__}")
        for i, item in enumerate(value):
            if not isinstance(item, str) or not item:
                self.fail(f"{key}[{i}]", f"must be a non-empty string, got {item!r:.40}")
        return value

    def token_id(self, key: str, n_tokens: int) -> int | None:
        """A token id inside the vocabulary, or None when absent."""
        value = self.scalar(key, int)
        if value is not None and not 0 <= value < n_tokens:
            self.fail(key, f"={value} is outside the vocabulary of {n_tokens}")
        return value

    def merges(self) -> list[tuple[str, str]]:
        """The byte-level BPE merges, each ``"left right"``."""
        key = "tokenizer.ggml.merges"
        merges = self.strings(key)
        if merges is None:
            self.fail(key, "is missing (a byte-level gpt2 tokenizer needs it)")
        pairs = []
        for i, merge in enumerate(merges or ()):
            left, space, right = merge.partition(" ")
            if not (left and space and right):
                self.fail(f"{key}[{i}]", f"must be two tokens separated by a space, got {merge!r:.40}")
            pairs.append((left, right))
        return pairs

    def numbers(self, key: str, length: int, integer: bool) -> list | None:
        """A numeric array of ``length`` values, or None when absent."""
        value = self.metadata.get(key)
        if value is None:
            return None
        array = np.asarray(value) if isinstance(value, (mx.array, np.ndarray)) else None
        if array is None or array.ndim != 1 or not (
            np.issubdtype(array.dtype, np.integer) if integer else np.issubdtype(array.dtype, np.number)
        ):
            self.fail(key, f"must be an array of {'integers' if integer else 'numbers'}")
        if len(array) != length:
            self.fail(key, f"has {len(array)} values for {length} tokens")
        return array.tolist()


def _byte_level_model(
    tokens: list[str], token_type: list[int] | None, merges: list[tuple[str, str]], pre: str | None
) -> HFTokenizer:
    """Byte-level BPE. Normal tokens are stored in GPT-2's byte alphabet; control and
    user-defined ones as their text (llama.cpp's converter writes them so, and matches them
    whole), so they keep their ids, whatever characters they have."""
    alphabet = set(bytes_to_unicode().values())
    spell = bytes_to_unicode()
    raw = {i for i, kind in enumerate(token_type or ()) if kind in (CONTROL, USER_DEFINED)}
    vocab = {
        tok if i in raw or set(tok) <= alphabet else "".join(spell[b] for b in tok.encode("utf-8")): i
        for i, tok in enumerate(tokens)
    }
    model = models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False, ignore_merges=pre in _IGNORE_MERGES)
    tok = HFTokenizer(model)
    tok.pre_tokenizer = _byte_level_pre_tokenizer(pre)
    tok.decoder = decoders.ByteLevel()
    return tok


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


def spm_bpe_tokenizer(
    tokens: list[str], scores: list[float], add_prefix_space: bool, legacy: bool = False,
    merges: list[tuple[str, str]] | None = None,
) -> HFTokenizer:
    """A SentencePiece BPE vocabulary as a `tokenizers` BPE with byte fallback, as transformers'
    LlamaTokenizer builds it: a Metaspace pre-tokenizer that adds the dummy-prefix space at the
    start of the text, or (``legacy``) also after every added token. ``merges``: the file's own
    (Gemma 4's ``gemma4`` vocabulary), else implied by the scores."""
    vocab = {tok: i for i, tok in enumerate(tokens)}
    merges = spm_merges(tokens, scores) if merges is None else merges
    model = models.BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True)
    tok = HFTokenizer(model)
    scheme = ("always" if legacy else "first") if add_prefix_space else "never"
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=scheme, split=False)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix_space:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    tok.decoder = decoders.Sequence(steps)
    return tok


def add_typed_tokens(tok: HFTokenizer, tokens: list[str], token_type: list[int] | None) -> None:
    """Control tokens become special added tokens, user-defined ones plain added tokens: both
    are matched whole in text, under their ids in the file (as llama.cpp's tokenizer does).
    The type numbers are llama.cpp's, which are SentencePiece's too."""
    if token_type is None:
        return
    tok.add_special_tokens(
        [AddedToken(t, normalized=False, special=True) for t, kind in zip(tokens, token_type) if kind == CONTROL]
    )
    vocab = tok.get_vocab(with_added_tokens=False)
    user = [
        AddedToken(t, normalized=False, special=False)
        for t, kind in zip(tokens, token_type)
        if kind == USER_DEFINED and t in vocab
    ]
    tok.add_tokens(user)


def build_gguf_vocab(metadata: dict[str, Any], source: str = "GGUF file") -> GGUFVocab:
    """Build the tokenizer described by GGUF ``metadata`` (e.g. ``mx.load(path,
    return_metadata=True)[1]``); ``source`` (the file) names where an ill-typed key was found.
    Every key is read and checked before anything is built."""
    meta = _Metadata(metadata, str(source))
    kind = meta.scalar("tokenizer.ggml.model", str)
    tokens = meta.strings("tokenizer.ggml.tokens")
    if kind is None or tokens is None:
        raise MlxformerError(f"{source}: no tokenizer (missing tokenizer.ggml.model / tokenizer.ggml.tokens)")
    if kind not in ("gpt2", "llama", "gemma4"):
        raise MlxformerError(f"{source}: unsupported tokenizer.ggml.model {kind!r} (supported: 'gpt2', 'llama', 'gemma4')")
    token_type = meta.numbers("tokenizer.ggml.token_type", len(tokens), integer=True)
    pre = meta.scalar("tokenizer.ggml.pre", str)
    ids = {name: meta.token_id(f"tokenizer.ggml.{key}", len(tokens)) for name, key in _SPECIAL_IDS.items()}
    add_bos = meta.scalar("tokenizer.ggml.add_bos_token", bool)
    add_eos = meta.scalar("tokenizer.ggml.add_eos_token", bool)
    chat_template = meta.scalar("tokenizer.chat_template", str)
    if kind == "gpt2":
        tok = _byte_level_model(tokens, token_type, meta.merges(), pre)
        default_bos = pre in _BOS_BY_DEFAULT  # llama.cpp's default for these pre-tokenizers
    elif kind == "gemma4":  # SentencePiece-style pieces (spaces as ▁, byte fallback) with stored merges
        tok = spm_bpe_tokenizer(tokens, [], False, merges=meta.merges())
        default_bos = True
    else:
        prefix = meta.scalar("tokenizer.ggml.add_space_prefix", bool)
        scores = meta.numbers("tokenizer.ggml.scores", len(tokens), integer=False)
        if scores is None:
            meta.fail("tokenizer.ggml.scores", "is missing (a SentencePiece llama tokenizer needs it)")
        tok = spm_bpe_tokenizer(tokens, scores, True if prefix is None else prefix)
        default_bos = True  # llama.cpp adds BOS to a SentencePiece vocabulary that does not say otherwise
    add_typed_tokens(tok, tokens, token_type)
    special = {name: tokens[i] for name, i in ids.items() if i is not None and name in _SPECIAL_NAMES}
    # transformers registers bos/eos/unk/pad as special tokens too, so they match whole in text.
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in special.values()])
    eos_ids = list(dict.fromkeys(i for name in ("eos_token", "eot_token", "eom_token") if (i := ids[name]) is not None))
    return GGUFVocab(
        tokenizer=tok,
        bos_token_id=ids["bos_token"],
        eos_token_ids=eos_ids,
        add_bos_token=default_bos if add_bos is None else add_bos,
        add_eos_token=bool(add_eos),
        special_tokens=special,
        chat_template=chat_template,
    )
