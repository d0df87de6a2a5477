"""The grammar engine's view of a tokenizer: an ``llguidance.LLTokenizer`` mapping every
token id to the bytes it stands for.

tokenizer.json and GGUF vocabularies (both ``HFBackend``) are handed to llguidance as the
tokenizer's JSON: its Rust side reads byte-level BPE, Metaspace and ``<0xNN>`` byte-fallback
tokens itself. SentencePiece models (``SPMBackend``) are described token by token.
"""

from __future__ import annotations

import json

import llguidance
import sentencepiece as spm
from sentencepiece import sentencepiece_model_pb2

from mlxformer.text.tokenizer import HFBackend, SPMBackend, Tokenizer

# llguidance marks special (control) tokens with a leading 0xFF byte, which no UTF-8 text contains.
SPECIAL_MARKER = b"\xff"


def grammar_tokenizer(tokenizer: Tokenizer, n_vocab: int) -> llguidance.LLTokenizer:
    """The ``LLTokenizer`` for ``tokenizer``, padded to ``n_vocab`` ids (the model's vocabulary
    may have padding rows past the tokenizer's last id: they are never allowed).

    Built once per tokenizer and size (about 0.3 s for a 49k vocabulary), then cached on the tokenizer.
    """
    n_vocab = max(n_vocab, tokenizer.vocab_size)
    cached = tokenizer.grammar_tokenizers.get(n_vocab)
    if cached is None:
        cached = _build(tokenizer, n_vocab)
        tokenizer.grammar_tokenizers[n_vocab] = cached
    return cached


def _build(tokenizer: Tokenizer, n_vocab: int) -> llguidance.LLTokenizer:
    backend = tokenizer.backend
    eos = list(tokenizer.eos_token_ids)
    if isinstance(backend, HFBackend):
        data = json.loads(backend.tok.to_str())
        data["padding"] = None
        data["truncation"] = None
        return llguidance.LLTokenizer(json.dumps(data), n_vocab=n_vocab, eos_token=eos)
    if isinstance(backend, SPMBackend):
        vocab = llguidance.TokenizerWrapper(_SentencePieceVocab(backend, tokenizer))
        return llguidance.LLTokenizer(vocab, n_vocab=n_vocab, eos_token=eos)
    raise TypeError(f"no grammar vocabulary for {type(backend).__name__}")


def sentencepiece_token_bytes(backend: SPMBackend) -> list[bytes]:
    """The bytes of every SentencePiece token: ``▁`` is a space, ``<0xNN>`` is byte NN, control,
    unknown and unused pieces are special (marked, never matched by a grammar)."""
    sp = backend.sp
    tokens = []
    for i in range(sp.get_piece_size()):
        piece = sp.id_to_piece(i)
        if sp.is_byte(i):
            tokens.append(bytes([int(piece[3:5], 16)]))  # "<0xNN>"
        elif sp.is_control(i) or sp.is_unknown(i) or sp.is_unused(i):
            tokens.append(SPECIAL_MARKER + piece.encode("utf-8"))
        else:
            tokens.append(piece.replace("\u2581", " ").encode("utf-8"))
    return tokens


class _SentencePieceVocab:
    """What ``LLTokenizer`` needs from a Python tokenizer: token bytes, special ids, EOS/BOS and an
    exact encoder (llguidance tokenizes text the grammar forces, and must get those very bytes back)."""

    def __init__(self, backend: SPMBackend, tokenizer: Tokenizer) -> None:
        self._sp = _raw_text_processor(backend)
        self.eos_token_id = tokenizer.eos_token_ids[0] if tokenizer.eos_token_ids else backend.sp.eos_id()
        self.bos_token_id = tokenizer.bos_token_id
        self.tokens = sentencepiece_token_bytes(backend)
        self.special_token_ids = [i for i, t in enumerate(self.tokens) if t.startswith(SPECIAL_MARKER)]
        self._ids = {t: i for i, t in reversed(list(enumerate(self.tokens))) if t and i not in self.special_token_ids}
        self._longest = max(map(len, self._ids), default=1)

    def __call__(self, data: bytes) -> list[int]:
        """Token ids spelling exactly the UTF-8 ``data`` (no BOS): SentencePiece's own split when it
        reproduces the bytes (its normalizer may not), else greedy longest matches."""
        ids = list(self._sp.encode(data.decode("utf-8", errors="replace")))
        if b"".join(self.tokens[i] for i in ids) == data:
            return ids
        return self._greedy(data)

    def _greedy(self, data: bytes) -> list[int]:
        ids, start = [], 0
        while start < len(data):
            for end in range(min(len(data), start + self._longest), start, -1):
                if (i := self._ids.get(data[start:end])) is not None:
                    ids.append(i)
                    start = end
                    break
            else:
                start += 1  # a byte no token spells (no byte fallback): skipped
        return ids


def _raw_text_processor(backend: SPMBackend) -> spm.SentencePieceProcessor:
    """The model's SentencePiece without the dummy-prefix space and whitespace folding, so that
    encoding a piece of text in the middle of the output does not invent a leading space."""
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(backend.model_proto)
    proto.normalizer_spec.add_dummy_prefix = False
    proto.normalizer_spec.remove_extra_whitespaces = False
    return spm.SentencePieceProcessor(model_proto=proto.SerializeToString())
