"""SentencePiece ``tokenizer.model`` backends, with the dir's added tokens.

A Llama-style model (BPE, identity normalization, whitespace kept, byte fallback: Llama,
Mistral, Gemma) becomes a `tokenizers` BPE exactly as transformers' ``LlamaTokenizer`` builds
it (``formats.gguf_vocab.spm_bpe_tokenizer``, shared with GGUF SentencePiece vocabularies), so
`tokenizers` splits added and special tokens out of the text. Any other model is run by the
`sentencepiece` library itself, with control and added tokens made user-defined pieces of a
copy of the model, so that `sentencepiece` matches them whole in text.
"""

from __future__ import annotations

import pathlib

import sentencepiece as spm
from sentencepiece import sentencepiece_model_pb2
from tokenizers import AddedToken

from mlxformer.errors import MlxformerError
from mlxformer.formats.gguf_vocab import CONTROL, add_typed_tokens, spm_bpe_tokenizer
from mlxformer.text.tokenizer_hf import HFBackend, add_tokens_at

_Piece = sentencepiece_model_pb2.ModelProto.SentencePiece
_BPE = 2


def _parse(proto: bytes, source: str) -> sentencepiece_model_pb2.ModelProto:
    model = sentencepiece_model_pb2.ModelProto()
    try:
        model.ParseFromString(proto)
    except Exception as exc:  # protobuf's DecodeError
        raise MlxformerError(f"{source}: not a SentencePiece model ({exc})") from None
    return model


def is_llama_style(model: sentencepiece_model_pb2.ModelProto) -> bool:
    """Whether transformers' BPE conversion reproduces ``sentencepiece`` on this model."""
    norm = model.normalizer_spec
    return (
        model.trainer_spec.model_type == _BPE and model.trainer_spec.byte_fallback
        and norm.name == "identity" and not norm.precompiled_charsmap and not norm.remove_extra_whitespaces
    )


def spm_special_tokens(proto: bytes, source: str) -> dict[str, str]:
    """bos_token / eos_token / unk_token -> text, as the model's trainer spec numbers them."""
    model = _parse(proto, source)
    spec, n = model.trainer_spec, len(model.pieces)
    ids = {"bos_token": spec.bos_id, "eos_token": spec.eos_id, "unk_token": spec.unk_id}
    return {key: model.pieces[i].piece for key, i in ids.items() if 0 <= i < n}


def spm_backend(
    proto: bytes, source: str, add_bos_token: bool | None, add_eos_token: bool, legacy: bool,
    added: list[tuple[int, AddedToken]], special: dict[str, str], extra_special: list[str] | None = None,
) -> HFBackend | SPMBackend:
    """The backend for a ``tokenizer.model`` plus its ``added`` ``(id, token)`` pairs;
    ``special`` maps bos_token/eos_token/unk_token to their text. ``extra_special`` is the
    config's ``additional_special_tokens`` when it has one: as in transformers, it then replaces
    the model's control pieces as the special tokens matched in text (besides bos/eos/unk)."""
    model = _parse(proto, source)
    if not is_llama_style(model):
        return SPMBackend(proto, add_bos_token, add_eos_token, added, source)
    tokens = [p.piece for p in model.pieces]
    tok = spm_bpe_tokenizer(tokens, [p.score for p in model.pieces], model.normalizer_spec.add_dummy_prefix, legacy)
    types = [p.type for p in model.pieces]
    if extra_special is not None:  # control pieces not named there are plain pieces
        types = [1 if kind == CONTROL and t not in extra_special else kind for t, kind in zip(tokens, types)]
    add_typed_tokens(tok, tokens, types)
    # transformers registers bos/eos/unk as special tokens too, so "<unk>" in text is the unknown id.
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in special.values() if t in tokens])
    add_tokens_at(tok, added, source)
    bos, eos = special.get("bos_token"), special.get("eos_token")
    return HFBackend(tok, True if add_bos_token is None else add_bos_token, add_eos_token, bos, eos)


class SPMBackend:
    """A SentencePiece model run by the `sentencepiece` library itself."""

    add_bos_token: bool | None

    def __init__(self, proto: bytes, add_bos_token: bool | None, add_eos_token: bool,
                 added: list[tuple[int, AddedToken]], source: str) -> None:
        self.sp = spm.SentencePieceProcessor(model_proto=proto)  # the model as trained: BOS/EOS ids, piece types
        self.model_proto = proto  # the serialized tokenizer.model
        self.add_bos_token = True if add_bos_token is None else add_bos_token  # SentencePiece/LLaMA default
        self.add_eos_token = add_eos_token
        self.added = added  # (id, token) pairs beside tokenizer.model, saved in tokenizer_config.json
        model = _parse(proto, source)
        special = {i for i, p in enumerate(model.pieces) if p.type == CONTROL}
        for i, p in enumerate(model.pieces):
            if p.type == CONTROL:  # matched in text like user-defined pieces; still special
                p.type = _Piece.USER_DEFINED
        for token_id, token in sorted(added, key=lambda item: item[0]):
            if token_id < len(model.pieces) and model.pieces[token_id].piece != token.content:
                raise MlxformerError(f"{source}: added token {token.content!r} has id {token_id}, "
                                     f"which is {model.pieces[token_id].piece!r} in tokenizer.model")
            if token_id > len(model.pieces):
                raise MlxformerError(f"{source}: added token {token.content!r} has id {token_id}, "
                                     f"but the next free id is {len(model.pieces)}")
            if token_id == len(model.pieces):
                model.pieces.add(piece=token.content, score=0.0, type=_Piece.USER_DEFINED)
            if token.special:
                special.add(token_id)
        self._text = spm.SentencePieceProcessor(model_proto=model.SerializeToString())
        self._special = frozenset(special)

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        ids = list(self._text.encode(text))
        if add_special_tokens and self.add_bos_token and self.sp.bos_id() >= 0:
            ids = [self.sp.bos_id()] + ids
        if add_special_tokens and self.add_eos_token and self.sp.eos_id() >= 0:
            ids = ids + [self.sp.eos_id()]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        """Control and added tokens show as their text unless skipped, as in transformers."""
        return self._text.decode([i for i in ids if not (skip_special_tokens and i in self._special)])

    def token_to_id(self, token: str) -> int | None:
        i = self._text.piece_to_id(token)
        return None if i == self._text.unk_id() and token != self._text.id_to_piece(i) else i

    def id_to_token(self, token_id: int) -> str | None:
        return self._text.id_to_piece(token_id) if 0 <= token_id < self._text.get_piece_size() else None

    def vocab_size(self) -> int:
        return self._text.get_piece_size()

    def holds(self, token_id: int) -> bool:
        return False  # sentencepiece decodes bytes locally: trailing U+FFFD handling is enough

    def save(self, directory: pathlib.Path) -> None:
        (directory / "tokenizer.model").write_bytes(self.model_proto)
