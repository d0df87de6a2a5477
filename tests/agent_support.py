"""Helpers for the agent-API tests: the families' published chat templates (llama.cpp keeps
copies in ``models/templates/``, unpacked from llama-cpp-python's sdist by
``scripts/install_test_deps.sh``), and replies rendered by them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hf_reference_cache import cache_root

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "</s>", "<|end_of_text|>")


def template_dir() -> Path:
    """``vendor/llama.cpp/models/templates`` of the unpacked llama-cpp-python sdist."""
    path = cache_root() / f"llama-cpp-python-{LLAMA_CPP_PYTHON_VERSION}" / "vendor" / "llama.cpp" / "models" / "templates"
    assert path.is_dir(), f"{path} is missing: run scripts/install_test_deps.sh"
    return path


def template(name: str) -> str:
    """The chat template llama.cpp ships as ``name``.jinja."""
    return (template_dir() / f"{name}.jinja").read_text(encoding="utf-8")


def render(source: str, messages: list[dict[str, Any]], generation_prompt: bool, **variables: Any) -> str:
    from mlxformer.text.tokenizer import _compile_template

    defaults = {"bos_token": "<s>", "eos_token": "</s>", "tools": None}
    return _compile_template(source).render(messages=messages, add_generation_prompt=generation_prompt,
                                            **{**defaults, **variables})


def rendered_reply(source: str, messages: list[dict[str, Any]], reply: dict[str, Any], **variables: Any) -> str:
    """The text of assistant message ``reply`` as the template writes it after ``messages``
    (what the model was trained to generate), without the end-of-turn token."""
    prompt = render(source, messages, True, **variables)
    full = render(source, [*messages, reply], False, **variables)
    assert full.startswith(prompt), "the template does not extend the generation prompt"
    text = full[len(prompt):].rstrip()
    for end in END_OF_TURN:
        if text.endswith(end):
            text = text[: -len(end)].rstrip()
    return text


EOS = "<|endoftext|>"


def write_chat_tokenizer(directory: Path, chat_template: str | None = None) -> int:
    """A byte-level tokenizer (the 256 byte tokens, no merges, ``<|endoftext|>`` as EOS) with
    ``chat_template``: any text encodes, one byte per token. Returns its vocabulary size."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=257, special_tokens=[EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["a"], trainer)
    tok.save(str(directory / "tokenizer.json"))
    config: dict[str, Any] = {"eos_token": EOS}
    if chat_template is not None:
        config["chat_template"] = chat_template
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return tok.get_vocab_size()


def tiny_chat_model(directory: Path, chat_template: str) -> tuple[Any, Any]:
    """A tiny random Llama (float32) with the byte-level tokenizer and ``chat_template``, loaded."""
    from conftest import write_tiny_checkpoint

    from mlxformer import load

    vocab = write_chat_tokenizer(directory, chat_template)
    write_tiny_checkpoint(directory, "llama", vocab_size=vocab, eos_token_id=0, bos_token_id=0)
    write_chat_tokenizer(directory, chat_template)  # save_pretrained may have written its own config
    return load(directory, threads=1)
