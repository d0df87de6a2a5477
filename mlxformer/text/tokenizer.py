"""Tokenizers for mlxformer: HF `tokenizer.json`, SentencePiece `tokenizer.model`, or GGUF metadata.

`Tokenizer` wraps one of two backends (`tokenizer_hf.HFBackend` over `tokenizers`, or
`tokenizer_spm.SPMBackend` over `sentencepiece`) and adds what lives outside them: BOS/EOS ids,
the chat template and streaming detokenization. Files in a model directory are only read,
never executed (no remote code).
"""

import copy
import json
import pathlib
from datetime import datetime
from typing import Any, Protocol

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken
from tokenizers import Tokenizer as HFTokenizer

from mlxformer.text.detokenizer import StreamingDetokenizer
from mlxformer.errors import MlxformerError
from mlxformer.formats.gguf_vocab import build_gguf_vocab
from mlxformer.formats.jsonio import read_json_object
from mlxformer.sampling.model_defaults import NO_DEFAULTS, SamplingDefaults
from mlxformer.text.tokenizer_hf import HFBackend
from mlxformer.text.tokenizer_spm import SPMBackend, spm_backend, spm_special_tokens

__all__ = ["Backend", "HFBackend", "SPMBackend", "Tokenizer", "load_tokenizer_from_dir", "load_tokenizer_from_gguf"]


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


class Tokenizer:
    """Text <-> token ids, chat template rendering and streaming detokenization."""

    def __init__(self, backend: Backend, bos_token_id: int | None, eos_token_ids: list[int],
                 chat_template: str | None, special_tokens: dict[str, str] | None = None,
                 sampling_defaults: SamplingDefaults = NO_DEFAULTS) -> None:
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids = list(dict.fromkeys(eos_token_ids))
        self.chat_template = chat_template
        self.special_tokens = dict(special_tokens or {})  # bos_token/eos_token/unk_token/pad_token -> text
        # n_vocab -> llguidance.LLTokenizer, built on first use by mlxformer.constrained.vocab
        self.grammar_tokenizers: dict[int, Any] = {}
        # the model's own sampling defaults (generation_config.json or GGUF metadata; model_defaults.py)
        self.sampling_defaults = sampling_defaults

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

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, continue_final_message: bool = False,
        **kwargs: Any,
    ) -> str:
        """Render `messages` with the chat template in a jinja2 sandbox, as transformers does. With
        ``continue_final_message`` the text ends where the last message's text ends (its turn left
        open, so more text can follow it), cut where transformers cuts it."""
        if self.chat_template is None:
            raise MlxformerError("this tokenizer has no chat template")
        if continue_final_message and add_generation_prompt:
            raise MlxformerError("continue_final_message and add_generation_prompt exclude each other")
        variables = {**self.special_tokens, **kwargs}
        variables.setdefault("tools", None)
        variables.setdefault("documents", None)
        if continue_final_message:
            messages, final_text = _tag_final_message(messages)
        try:
            text = _compile_template(self.chat_template).render(
                messages=messages, add_generation_prompt=add_generation_prompt, **variables
            )
        except jinja2.TemplateError as exc:  # includes SecurityError and raise_exception()
            raise MlxformerError(f"chat template error: {exc}") from exc
        return _cut_at_tag(text, final_text) if continue_final_message else text

    def encode_prompt(
        self, prompt: str, system: str | None = None, use_template: bool = True, add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> list[int]:
        """Token ids for a user prompt: through the chat template when there is one and
        ``use_template``; otherwise the raw text (``system`` is then ignored). With
        ``continue_final_message`` the user turn stays open (no end-of-turn, no assistant header)."""
        if use_template and self.chat_template:
            messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
            text = self.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt and not continue_final_message,
                continue_final_message=continue_final_message,
            )
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
            config["added_tokens_decoder"] = {
                str(i): {"content": t.content, "special": t.special, "lstrip": t.lstrip, "rstrip": t.rstrip,
                         "normalized": t.normalized, "single_word": t.single_word}
                for i, t in self.backend.added
            }
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
            ids.update(self.sampling_defaults.generation_config())
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


def _added_tokens(
    path: pathlib.Path, config: dict[str, Any], special: dict[str, str], extra_special: list[str]
) -> list[tuple[int, AddedToken]]:
    """A SentencePiece dir's added tokens: tokenizer_config.json's ``added_tokens_decoder``
    (``{id: {content, special, lstrip, ...}}``) and ``added_tokens.json`` (``{content: id}``;
    special when named as bos/eos/unk/pad or an additional special token), as transformers reads them."""
    where = path / "tokenizer_config.json"
    decoder = config.get("added_tokens_decoder") or {}
    if not isinstance(decoder, dict):
        raise MlxformerError(f"{where}: added_tokens_decoder must be an object")
    added: dict[int, AddedToken] = {}
    for key, entry in decoder.items():
        content = entry.get("content") if isinstance(entry, dict) else None
        if not str(key).isdigit() or not isinstance(content, str) or not content:
            raise MlxformerError(f"{where}: added_tokens_decoder[{key!r}] must map an id to {{\"content\": ...}}")
        flags = {k: bool(entry.get(k, False)) for k in ("lstrip", "rstrip", "single_word")}
        added[int(key)] = AddedToken(content, special=bool(entry.get("special", False)),
                                     normalized=bool(entry.get("normalized", False)), **flags)
    named = set(special.values()) | set(extra_special)
    for content, token_id in _read_json(path / "added_tokens.json").items():
        if not isinstance(token_id, int) or isinstance(token_id, bool) or token_id < 0:
            raise MlxformerError(f"{path / 'added_tokens.json'}: the id of {content!r} must be a non-negative integer")
        added.setdefault(token_id, AddedToken(content, special=content in named, normalized=False))
    return sorted(added.items(), key=lambda item: item[0])


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
        proto = (path / "tokenizer.model").read_bytes()
        special = {**spm_special_tokens(proto, str(path / "tokenizer.model")), **special}
        extra = config.get("additional_special_tokens", config.get("extra_special_tokens"))
        extra_special = [t for t in map(_token_text, extra) if t] if isinstance(extra, list) else None
        backend = spm_backend(proto, str(path / "tokenizer.model"), add_bos, add_eos, legacy,
                              _added_tokens(path, config, special, extra_special or []), special, extra_special)
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
    return Tokenizer(backend, bos_id, eos_ids, _chat_template(path, config), special,
                     SamplingDefaults.from_generation_config(generation))


def load_tokenizer_from_gguf(metadata: dict[str, Any], source: str | pathlib.Path = "GGUF file") -> Tokenizer:
    """Build the tokenizer stored in GGUF metadata (as returned by `mx.load(path, return_metadata=True)[1]`);
    ``source`` (the file) is named in errors."""
    vocab = build_gguf_vocab(metadata, str(source))
    backend = HFBackend(vocab.tokenizer, vocab.add_bos_token, vocab.add_eos_token,
                        vocab.special_tokens.get("bos_token"), vocab.special_tokens.get("eos_token"))
    return Tokenizer(backend, vocab.bos_token_id, vocab.eos_token_ids, vocab.chat_template, vocab.special_tokens,
                     SamplingDefaults.from_gguf(metadata))


_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "  # transformers' marker, so the two cut alike


def _tag_final_message(messages: list[dict]) -> tuple[list[dict], str]:
    """A copy of ``messages`` whose last text (its content, or its last text part) ends in
    `_CONTINUE_TAG`, and that text."""
    if not messages:
        raise MlxformerError("continue_final_message needs a message to continue")
    final = copy.deepcopy(messages[-1])
    content = final.get("content")
    if isinstance(content, str):
        text, final["content"] = content, content + _CONTINUE_TAG
    else:
        part = next((p for p in reversed(content or []) if isinstance(p, dict) and "text" in p), None)
        if part is None:
            raise MlxformerError("continue_final_message: the final message has no text to continue")
        text, part["text"] = part["text"], part["text"] + _CONTINUE_TAG
    return [*messages[:-1], final], text


def _cut_at_tag(rendered: str, text: str) -> str:
    """``rendered`` up to the tag: where the template kept the tag's space it kept the text's
    trailing spaces too; where it trimmed them, they are trimmed."""
    if text.strip() not in rendered or _CONTINUE_TAG.strip() not in rendered:
        raise MlxformerError("the chat template does not keep the final message's text, so it cannot be continued")
    at = rendered.rindex(_CONTINUE_TAG.strip())
    return rendered[:at] if rendered[at: at + len(_CONTINUE_TAG)] == _CONTINUE_TAG else rendered[:at].rstrip()
