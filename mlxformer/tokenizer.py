"""Tokenizers for mlxformer: HF `tokenizer.json`, SentencePiece `tokenizer.model`, or GGUF metadata.

`Tokenizer` wraps one of two backends (`tokenizers.Tokenizer` or `sentencepiece`) and adds what
lives outside them: BOS/EOS ids, the chat template and streaming detokenization. Files in a
model directory are only read, never executed (no remote code).
"""

import json
import pathlib
import re
from datetime import datetime
from typing import Any, Protocol

import jinja2
import sentencepiece as spm
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import processors

from mlxformer.detokenizer import StreamingDetokenizer
from mlxformer.errors import MlxformerError
from mlxformer.formats.gguf_vocab import build_gguf_vocab
from mlxformer.formats.jsonio import read_json_object

_BYTE_TOKEN = re.compile(r"^<0x[0-9A-Fa-f]{2}>$")


class Backend(Protocol):
    """The encode/decode engine behind `Tokenizer`."""

    add_bos_token: bool | None  # None: decided by the backend itself (tokenizer.json post-processor)

    def encode(self, text: str, add_special_tokens: bool) -> list[int]: ...
    def decode(self, ids: list[int], skip_special_tokens: bool) -> str: ...
    def token_to_id(self, token: str) -> int | None: ...
    def id_to_token(self, token_id: int) -> str | None: ...
    def vocab_size(self) -> int: ...
    def holds(self, token_id: int) -> bool: ...
    def save(self, directory: pathlib.Path) -> None: ...


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


class SPMBackend:
    """A SentencePiece model used through the `sentencepiece` library itself."""

    def __init__(
        self, proto: bytes, add_bos_token: bool | None = None, add_eos_token: bool = False, legacy: bool = False
    ) -> None:
        self.sp = spm.SentencePieceProcessor(model_proto=proto)
        self.model_proto = proto  # the serialized tokenizer.model
        self.add_bos_token = True if add_bos_token is None else add_bos_token  # SentencePiece/LLaMA default
        self.add_eos_token = add_eos_token
        self.legacy = legacy
        n = self.sp.get_piece_size()
        self._control = frozenset(i for i in range(n) if self.sp.is_control(i))
        # Control and unknown pieces written in the text ("<s>", "</s>", "<unk>") encode to their
        # ids, as transformers' added special tokens do; sentencepiece would spell them out.
        specials = {self.sp.id_to_piece(i): i for i in range(n) if self.sp.is_control(i) or self.sp.is_unknown(i)}
        self._specials = {piece: i for piece, i in specials.items() if piece}
        pattern = "|".join(re.escape(p) for p in sorted(self._specials, key=len, reverse=True))
        self._special_split = re.compile(f"({pattern})") if pattern else None
        self._no_prefix = _without_dummy_prefix(proto)
        # A one-character piece that decodes to itself: decoding `[sentinel] + run` and dropping the
        # sentinel keeps the spaces sentencepiece would strip at the very start of the text.
        self._sentinel = next(
            (i for i in range(n) if self._is_plain(i) and len(p := self.sp.id_to_piece(i)) == 1
             and not p.isspace() and self.sp.decode([i]) == p),
            None,
        )

    def _is_plain(self, i: int) -> bool:
        sp = self.sp
        return not (sp.is_control(i) or sp.is_unknown(i) or sp.is_unused(i) or sp.is_byte(i))

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        parts = self._special_split.split(text) if self._special_split else [text]
        ids: list[int] = []
        for k, part in enumerate(parts):  # text, special, text, special, ..., text
            if k % 2:
                ids.append(self._specials[part])
            elif part:
                ids += self._encode_text(part, first=k == 0)
        if add_special_tokens and self.add_bos_token and self.sp.bos_id() >= 0:
            ids = [self.sp.bos_id()] + ids
        if add_special_tokens and self.add_eos_token and self.sp.eos_id() >= 0:
            ids = ids + [self.sp.eos_id()]
        return ids

    def _encode_text(self, text: str, first: bool) -> list[int]:
        """sentencepiece on text between special tokens. After a special token, transformers'
        Llama tokenizer adds the dummy-prefix space only in legacy mode, and never before a space."""
        if first or (self.legacy and not text.startswith(" ")):
            return self.sp.encode(text)
        return self._no_prefix.encode(text)

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        # sentencepiece drops control tokens; show them as text unless asked to skip, like transformers.
        parts: list[str] = []
        run: list[int] = []
        for i in ids:
            if i in self._control:
                parts.append(self._decode_run(run, first=not any(parts)))
                run = []
                parts.append("" if skip_special_tokens else self.sp.id_to_piece(i))
            else:
                run.append(i)
        parts.append(self._decode_run(run, first=not any(parts)))
        return "".join(parts)

    def _decode_run(self, run: list[int], first: bool) -> str:
        if not run:
            return ""
        if first or self._sentinel is None:
            return self.sp.decode(run)
        # Not the start of the text: keep leading spaces that sentencepiece strips at the start.
        return self.sp.decode([self._sentinel] + run)[1:]

    def token_to_id(self, token: str) -> int | None:
        i = self.sp.piece_to_id(token)
        return None if i == self.sp.unk_id() and token != self.sp.id_to_piece(i) else i

    def id_to_token(self, token_id: int) -> str | None:
        return self.sp.id_to_piece(token_id) if 0 <= token_id < self.sp.get_piece_size() else None

    def vocab_size(self) -> int:
        return self.sp.get_piece_size()

    def holds(self, token_id: int) -> bool:
        return False  # sentencepiece decodes bytes locally: trailing U+FFFD handling is enough

    def save(self, directory: pathlib.Path) -> None:
        (directory / "tokenizer.model").write_bytes(self.model_proto)


def _without_dummy_prefix(proto: bytes) -> spm.SentencePieceProcessor:
    """The model of ``proto`` with ``add_dummy_prefix`` off (as transformers' LlamaTokenizer builds it)."""
    from sentencepiece import sentencepiece_model_pb2

    model = sentencepiece_model_pb2.ModelProto()
    model.ParseFromString(proto)
    model.normalizer_spec.add_dummy_prefix = False
    return spm.SentencePieceProcessor(model_proto=model.SerializeToString())


def _template_processor(tok: HFTokenizer, bos: str | None, eos: str | None) -> processors.TemplateProcessing:
    """The post-processor transformers builds for explicit add_bos_token / add_eos_token."""
    special = [(t, tok.token_to_id(t)) for t in (bos, eos) if t is not None]
    for t, i in special:
        if i is None:
            raise MlxformerError(f"special token {t!r} is not in the vocabulary")
    single = " ".join(([f"{bos}:0"] if bos else []) + ["$A:0"] + ([f"{eos}:0"] if eos else []))
    pair = single + " " + " ".join(([f"{bos}:1"] if bos else []) + ["$B:1"] + ([f"{eos}:1"] if eos else []))
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=list(dict.fromkeys(special)))


class Tokenizer:
    """Text <-> token ids, chat template rendering and streaming detokenization."""

    def __init__(self, backend: Backend, bos_token_id: int | None, eos_token_ids: list[int],
                 chat_template: str | None, special_tokens: dict[str, str] | None = None) -> None:
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids = list(dict.fromkeys(eos_token_ids))
        self.chat_template = chat_template
        self.special_tokens = dict(special_tokens or {})  # bos_token/eos_token/unk_token/pad_token -> text
        # n_vocab -> llguidance.LLTokenizer, built on first use by mlxformer.constrained.vocab
        self.grammar_tokenizers: dict[int, Any] = {}

    @property
    def vocab_size(self) -> int:
        """Number of token ids, including added tokens."""
        return self.backend.vocab_size()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids for `text`; BOS is added only if the tokenizer is configured to add it."""
        if not isinstance(text, str):
            raise MlxformerError(f"encode expects a str, got {type(text).__name__}")
        return self.backend.encode(text, add_special_tokens)

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        """Text for `ids`. Ids past the vocabulary (the padding rows some models' embeddings have
        beyond the tokenizer, e.g. Qwen2.5) decode to "", as in transformers."""
        ids = [int(i) for i in ids]
        if bad := [i for i in ids if i < 0]:
            raise MlxformerError(f"token id {bad[0]} is negative")
        vocab = self.backend.vocab_size()
        return self.backend.decode([i for i in ids if i < vocab], skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        """The id of a single token string, or None."""
        return self.backend.token_to_id(token)

    def detokenizer(self, skip_special_tokens: bool = False) -> StreamingDetokenizer:
        """A fresh streaming detokenizer consistent with `decode`."""
        return StreamingDetokenizer(lambda ids: self.decode(ids, skip_special_tokens), self.backend.holds)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """Render `messages` with the chat template in a jinja2 sandbox, as transformers does."""
        if self.chat_template is None:
            raise MlxformerError("this tokenizer has no chat template")
        variables = {**self.special_tokens, **kwargs}
        variables.setdefault("tools", None)
        variables.setdefault("documents", None)
        try:
            return _compile_template(self.chat_template).render(
                messages=messages, add_generation_prompt=add_generation_prompt, **variables
            )
        except jinja2.TemplateError as exc:  # includes SecurityError and raise_exception()
            raise MlxformerError(f"chat template error: {exc}") from exc

    def encode_prompt(
        self, prompt: str, system: str | None = None, use_template: bool = True, add_generation_prompt: bool = True
    ) -> list[int]:
        """Token ids for a user prompt: through the chat template when there is one and
        ``use_template``; otherwise the raw text (``system`` is then ignored)."""
        if use_template and self.chat_template:
            messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
            text = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
            return self.encode(text, add_special_tokens=False)
        return self.encode(prompt)

    def save(self, directory: pathlib.Path, generation_config: bool = False) -> None:
        """Write tokenizer.json (or tokenizer.model) + tokenizer_config.json loadable by transformers and us;
        with ``generation_config``, also generation_config.json with every end-of-sequence id (eos and
        end-of-turn), which transformers, mlx-lm and our loader read."""
        directory = pathlib.Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.backend.save(directory)
        config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
        if isinstance(self.backend, SPMBackend):
            config["tokenizer_class"] = "LlamaTokenizer"
            config["legacy"] = self.backend.legacy
        config.update(self.special_tokens)
        if self.backend.add_bos_token is not None:
            config["add_bos_token"] = self.backend.add_bos_token
            config["add_eos_token"] = False
        if self.chat_template is not None:
            config["chat_template"] = self.chat_template
        text = json.dumps(config, indent=2, ensure_ascii=False)
        (directory / "tokenizer_config.json").write_text(text + "\n", encoding="utf-8")
        if generation_config:
            ids: dict[str, Any] = {"eos_token_id": self.eos_token_ids}
            if self.bos_token_id is not None:
                ids = {"bos_token_id": self.bos_token_id, **ids}
            (directory / "generation_config.json").write_text(json.dumps(ids, indent=2) + "\n", encoding="utf-8")


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise MlxformerError(f"chat template does not parse: {exc}") from exc


def _read_json(path: pathlib.Path) -> dict[str, Any]:
    """The JSON object in an optional file (``{}`` when it is absent)."""
    return read_json_object(path) if path.is_file() else {}


def _token_text(value: Any) -> str | None:
    """A special token from tokenizer_config: a string or an AddedToken dict {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _id_list(value: Any) -> list[int]:
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) for v in values):
        raise MlxformerError(f"eos_token_id must be an int or a list of ints, got {value!r}")
    return list(values)


def _chat_template(path: pathlib.Path, config: dict[str, Any]) -> str | None:
    jinja_file = path / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def load_tokenizer_from_dir(path: pathlib.Path) -> Tokenizer:
    """Load a HF-layout tokenizer: tokenizer.json (preferred) or SentencePiece tokenizer.model."""
    path = pathlib.Path(path)
    config = _read_json(path / "tokenizer_config.json")
    add_bos = config.get("add_bos_token")
    if add_bos is not None and not isinstance(add_bos, bool):
        raise MlxformerError(f"{path / 'tokenizer_config.json'}: add_bos_token must be true or false")
    add_eos = bool(config.get("add_eos_token", False))
    special = {k: t for k in ("bos_token", "eos_token", "unk_token", "pad_token") if (t := _token_text(config.get(k)))}
    backend: Backend
    if (path / "tokenizer.json").is_file():
        try:
            tok = HFTokenizer.from_file(str(path / "tokenizer.json"))
        except Exception as exc:  # tokenizers raises a bare Exception on bad files
            raise MlxformerError(f"cannot load {path / 'tokenizer.json'}: {exc}") from exc
        backend = HFBackend(tok, add_bos, add_eos, special.get("bos_token"), special.get("eos_token"))
    elif (path / "tokenizer.model").is_file():
        legacy = config.get("legacy", False)  # transformers' default for LlamaTokenizer
        if not isinstance(legacy, bool):
            raise MlxformerError(f"{path / 'tokenizer_config.json'}: legacy must be true or false")
        backend = SPMBackend((path / "tokenizer.model").read_bytes(), add_bos, add_eos, legacy)
        sp = backend.sp
        for key, sp_id in (("bos_token", sp.bos_id()), ("eos_token", sp.eos_id()), ("unk_token", sp.unk_id())):
            if sp_id >= 0:
                special.setdefault(key, sp.id_to_piece(sp_id))
    else:
        raise MlxformerError(f"no tokenizer.json or tokenizer.model in {path}")

    model_config = _read_json(path / "config.json")
    generation = _read_json(path / "generation_config.json")

    def lookup(key: str) -> int | None:
        token = special.get(key)
        return None if token is None else backend.token_to_id(token)

    bos_id = lookup("bos_token")
    if bos_id is None and isinstance(model_config.get("bos_token_id"), int):
        bos_id = model_config["bos_token_id"]
    eos_ids = [i for i in [lookup("eos_token")] if i is not None] + _id_list(generation.get("eos_token_id"))
    if not eos_ids:
        eos_ids = _id_list(model_config.get("eos_token_id"))
    return Tokenizer(backend, bos_id, eos_ids, _chat_template(path, config), special)


def load_tokenizer_from_gguf(metadata: dict[str, Any]) -> Tokenizer:
    """Build the tokenizer stored in GGUF metadata (as returned by `mx.load(path, return_metadata=True)[1]`)."""
    vocab = build_gguf_vocab(metadata)
    backend = HFBackend(vocab.tokenizer, vocab.add_bos_token, vocab.add_eos_token,
                        vocab.special_tokens.get("bos_token"), vocab.special_tokens.get("eos_token"))
    return Tokenizer(backend, vocab.bos_token_id, vocab.eos_token_ids, vocab.chat_template, vocab.special_tokens)
