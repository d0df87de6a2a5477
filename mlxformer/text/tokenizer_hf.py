"""The `tokenizers` backend of `Tokenizer`: tokenizer.json, GGUF vocabularies and SentencePiece
BPE models converted as transformers converts them. Added and special tokens are split out of
the text by the `tokenizers` library itself."""

from __future__ import annotations

import pathlib
import re

from tokenizers import AddedToken, processors
from tokenizers import Tokenizer as HFTokenizer

from mlxformer.errors import MlxformerError

_BYTE_TOKEN = re.compile(r"^<0x[0-9A-Fa-f]{2}>$")


class HFBackend:
    """A `tokenizers.Tokenizer` (from tokenizer.json or built from GGUF metadata)."""

    def __init__(self, tok: HFTokenizer, add_bos_token: bool | None = None, add_eos_token: bool = False,
                 bos_token: str | None = None, eos_token: str | None = None) -> None:
        self.tok = tok
        self.add_bos_token = add_bos_token
        if add_bos_token is not None:
            tok.post_processor = _template_processor(tok, bos_token if add_bos_token else None,
                                                     eos_token if add_eos_token else None)
        decoder = tok.decoder
        byte_fallback = decoder is not None and "ByteFallback" in decoder.__getstate__().decode("utf-8")
        self._byte_ids = frozenset(
            i for t, i in tok.get_vocab(with_added_tokens=False).items() if byte_fallback and _BYTE_TOKEN.match(t)
        )

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        # encode_batch releases the GIL (encode does not): a long prompt tokenized on one thread
        # must not stall the others (the server's event loop, the engine).
        return self.tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.tok.id_to_token(token_id)

    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    def holds(self, token_id: int) -> bool:
        """Byte-fallback tokens are decoded as a group, so the stream waits for the group to end."""
        return token_id in self._byte_ids

    def save(self, directory: pathlib.Path) -> None:
        self.tok.save(str(directory / "tokenizer.json"))


def add_tokens_at(tok: HFTokenizer, added: list[tuple[int, AddedToken]], source: str) -> None:
    """Add ``(id, token)`` pairs (``added_tokens_decoder`` / ``added_tokens.json``) to ``tok``: a
    token already in the vocabulary must be there under its id; new ones follow the vocabulary
    in id order, as `tokenizers` numbers them."""
    for token_id, token in sorted(added, key=lambda item: item[0]):
        known = tok.token_to_id(token.content)
        if known is None and token_id != tok.get_vocab_size(with_added_tokens=True):
            raise MlxformerError(
                f"{source}: added token {token.content!r} has id {token_id}, but the next free id is "
                f"{tok.get_vocab_size(with_added_tokens=True)}"
            )
        if known is not None and known != token_id:
            raise MlxformerError(f"{source}: added token {token.content!r} has id {token_id}, but the vocabulary has it as {known}")
        if token.special:
            tok.add_special_tokens([token])
        else:
            tok.add_tokens([token])


def _template_processor(tok: HFTokenizer, bos: str | None, eos: str | None) -> processors.TemplateProcessing:
    """The post-processor transformers builds for explicit add_bos_token / add_eos_token."""
    special = [(t, tok.token_to_id(t)) for t in (bos, eos) if t is not None]
    for t, i in special:
        if i is None:
            raise MlxformerError(f"special token {t!r} is not in the vocabulary")
    single = " ".join(([f"{bos}:0"] if bos else []) + ["$A:0"] + ([f"{eos}:0"] if eos else []))
    pair = single + " " + " ".join(([f"{bos}:1"] if bos else []) + ["$B:1"] + ([f"{eos}:1"] if eos else []))
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=list(dict.fromkeys(special)))
