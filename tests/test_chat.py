"""``mlxformer chat``: cache reuse between turns, trimming, /save and /load, the REPL.

A tiny random model with SmolLM2's vocabulary pairs with the real tokenizer and chat
template, so turns are cheap; references are fresh uncached-prefix generations.
"""

from __future__ import annotations

import io
import os
import sys
from pathlib import Path

import mlx.core as mx
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from mlxformer.cache import CacheSettings  # noqa: E402
from mlxformer.generation.chat import ChatSession
from mlxformer.cli.chat import run_repl  # noqa: E402
from mlxformer.cli import main  # noqa: E402
from mlxformer.models.config import ModelArgs  # noqa: E402
from mlxformer.errors import MlxformerError  # noqa: E402
from mlxformer.generation.stream import stream_generate  # noqa: E402
from mlxformer.models.decoder import Model  # noqa: E402

MAX_TOKENS = 10


@pytest.fixture(scope="module")
def tokenizer():
    from mlxformer.default_model import default_model_path
    from mlxformer.loader import load

    return load(default_model_path())[1]


@pytest.fixture(scope="module")
def model(tokenizer) -> Model:
    mx.random.seed(7)
    model = Model(ModelArgs.from_dict(dict(
        model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=49152,
        tie_word_embeddings=True,
    )))
    mx.eval(model.parameters())
    return model


def render_ids(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    return tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True), add_special_tokens=False)


def shared_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def fresh_reply(model, tokenizer, ids: list[int]) -> list[int]:
    return [r.token for r in stream_generate(model, tokenizer, ids, MAX_TOKENS)]


@pytest.mark.parametrize("settings", [None, CacheSettings(kv_bits=8)], ids=["float", "8bit"])
def test_second_turn_prefills_only_new_tokens(model, tokenizer, settings) -> None:
    system = {"role": "system", "content": "You answer briefly."}
    session = ChatSession(model, tokenizer, system=system["content"], max_tokens=MAX_TOKENS, cache_settings=settings)
    first = list(session.send("Hello there"))
    ids1 = render_ids(tokenizer, [system, {"role": "user", "content": "Hello there"}])
    assert session.last_prefill_tokens == len(ids1)
    cached = list(session.cached_ids)
    assert len(cached) == session.cache[0].offset > len(ids1)
    assert cached == (ids1 + [r.token for r in first])[: len(cached)]

    second = list(session.send("Tell me more."))
    reply1 = "".join(r.text for r in first)
    ids2 = render_ids(tokenizer, [
        system, {"role": "user", "content": "Hello there"},
        {"role": "assistant", "content": reply1}, {"role": "user", "content": "Tell me more."},
    ])
    common = shared_prefix(ids2, cached)
    print(f"\nturn 2: {len(ids2)} tokens, {common} reused, {session.last_prefill_tokens} prefilled")
    assert common >= len(ids1)
    assert session.last_prefill_tokens == len(ids2) - common
    if settings is None:  # float cache: the reply equals generating from scratch
        assert [r.token for r in second] == fresh_reply(model, tokenizer, ids2)


def test_edited_history_trims_cache_to_common_prefix(model, tokenizer) -> None:
    session = ChatSession(model, tokenizer, max_tokens=MAX_TOKENS)
    list(session.send("What is the tallest mountain?"))
    cached = list(session.cached_ids)
    session.messages[0]["content"] = "What is the longest river?"  # the user rewrites history
    reply = [r.token for r in session.send("Why?")]
    ids = render_ids(tokenizer, session.messages[:-1])
    common = shared_prefix(ids, cached)
    assert common < len(cached) - MAX_TOKENS  # really trimmed back into the first prompt
    assert session.last_prefill_tokens == len(ids) - common
    assert reply == fresh_reply(model, tokenizer, ids)


def test_rotating_cache_that_evicted_restarts_the_prefill(model, tokenizer) -> None:
    session = ChatSession(model, tokenizer, max_tokens=MAX_TOKENS, cache_settings=CacheSettings(max_kv_size=24))
    list(session.send("Hello"))  # the default system prompt alone overflows 24 tokens
    session.messages[0]["content"] = "Hi"
    list(session.send("Again"))
    assert session.last_prefill_tokens == len(render_ids(tokenizer, session.messages[:-1]))



def test_ctrl_c_mid_step_leaves_a_session_that_answers_as_a_fresh_one(model, tokenizer, monkeypatch) -> None:
    """Ctrl-C inside a forward (the cache already holds a token the reply never handed out): the
    reply ends, and the next turn answers exactly as generating the conversation from scratch."""
    session = ChatSession(model, tokenizer, max_tokens=MAX_TOKENS)
    forward, calls = Model.last_logits, []

    def interrupted_forward(self, *args, **kwargs):
        out = forward(self, *args, **kwargs)
        calls.append(1)
        if len(calls) == 4:
            mx.eval(out)
            raise KeyboardInterrupt
        return out

    monkeypatch.setattr(Model, "last_logits", interrupted_forward)
    with pytest.raises(KeyboardInterrupt):
        list(session.send("Hello there"))
    monkeypatch.setattr(Model, "last_logits", forward)
    reply = [r.token for r in session.send("Tell me more.")]
    ids = render_ids(tokenizer, session.messages[:-1])
    assert session.messages[1]["role"] == "assistant" and session.last_prefill_tokens == len(ids)
    assert reply == fresh_reply(model, tokenizer, ids)


@pytest.mark.parametrize("name", ["chat.safetensors", "conv"])  # any file name
def test_repl_save_reset_load_round_trip(model, tokenizer, tmp_path: Path, monkeypatch, name: str) -> None:
    monkeypatch.chdir(tmp_path)
    path = name
    saved = ChatSession(model, tokenizer, max_tokens=MAX_TOKENS)
    out = io.StringIO()
    run_repl(saved, io.StringIO(f"Hello there\n/save {path}\n/reset\n/stats\n/load {path}\n/stats\nWhat next?\n/exit\nnever\n"), out)
    straight = ChatSession(model, tokenizer, max_tokens=MAX_TOKENS)
    run_repl(straight, io.StringIO("Hello there\nWhat next?\n"), io.StringIO())
    lines = out.getvalue().splitlines()
    n_saved = int(next(line for line in lines if line.startswith("[saved")).split()[1])
    contexts = [int(line.split()[1]) for line in lines if line.startswith("context:")]
    assert contexts == [0, n_saved] and n_saved > 20
    assert saved.messages == straight.messages and len(saved.messages) == 4  # 2 user turns, 2 replies
    assert saved.cached_ids == straight.cached_ids
    assert saved.last_prefill_tokens == straight.last_prefill_tokens < n_saved  # the loaded cache was reused
    assert not any("never" in m["content"] for m in saved.messages)  # /exit stopped the loop
    assert [p.name for p in tmp_path.iterdir()] == [name]  # written under exactly that name


def test_load_refuses_other_weights_and_conflicting_cache_settings(model, tokenizer, tmp_path: Path) -> None:
    session = ChatSession(model, tokenizer, max_tokens=3)
    list(session.send("Hello there"))
    session.save(str(tmp_path / "conv"))
    other = Model(model.args)  # equal shapes, other (random) weights
    mx.eval(other.parameters())
    out = io.StringIO()
    run_repl(ChatSession(other, tokenizer), io.StringIO(f"/load {tmp_path / 'conv'}\n"), out)
    assert out.getvalue().startswith("[error: ") and "different model weights" in out.getvalue()
    eight_bit = ChatSession(model, tokenizer, cache_settings=CacheSettings(kv_bits=8))
    with pytest.raises(MlxformerError, match="conflicts with the requested kv_bits=8"):
        eight_bit.load(str(tmp_path / "conv"))
    same = ChatSession(model, tokenizer, cache_settings=CacheSettings())
    same.load(str(tmp_path / "conv"))
    assert same.cached_ids == session.cached_ids and same.messages == session.messages


def test_cli_chat_save_and_load_a_file_without_suffix(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hi\n/save conv\n/reset\n/load conv\n/stats\n/exit\n"))
    assert main(["chat", "--max-tokens", "3"]) == 0
    out = capsys.readouterr().out
    saved = int(out.split("[saved ")[1].split()[0])
    assert f"[loaded {saved} tokens, 2 messages from conv]" in out and f"context: {saved} tokens" in out
    assert "error" not in out and [p.name for p in tmp_path.iterdir()] == ["conv"]


def test_cli_chat_with_piped_stdin(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hi\n/stats\n/exit\n"))
    assert main(["chat", "--max-tokens", "3", "--kv-bits", "8"]) == 0
    out = capsys.readouterr().out
    assert "context:" in out and "cache:" in out


def test_repl_in_a_terminal_ctrl_c_stops_the_reply_and_ctrl_d_leaves(smollm_gguf):
    """``mlxformer chat`` on a pseudo-terminal, as a user types: Ctrl-C during a long reply ends
    that reply and the prompt comes back (the REPL lives on, and the next answer is greedy
    SmolLM2's "Paris"); Ctrl-C at the prompt says how to leave; Ctrl-D leaves on a new line, exit 0."""
    import pexpect

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "HF_HUB_OFFLINE": "1"}
    child = pexpect.spawn(sys.executable, ["-m", "mlxformer", "chat", "--model", str(smollm_gguf), "--temp", "0",
                                           "--max-tokens", "3000"], env=env, encoding="utf-8", timeout=180)
    try:
        child.expect_exact(">> ")
        child.sendline("Write a long story about a dragon.")
        child.expect_exact("\r\nOnce upon a time")  # the reply is streaming
        child.sendintr()
        child.expect_exact(">> ", timeout=30)  # the whole story would take minutes
        child.sendline("/reset")
        child.expect_exact(">> ")
        child.sendline("What is the capital of France?")
        child.expect_exact("Paris")
        child.expect_exact(">> ")
        child.sendintr()
        child.expect_exact("(Ctrl-D or /exit leaves the chat)")
        child.expect_exact(">> ")
        child.sendeof()
        child.expect(pexpect.EOF)
        assert child.before == "\r\n"
    finally:
        child.close(force=True)
    assert child.exitstatus == 0


def test_repl_save_keeps_an_existing_file_and_load_refuses_a_cache_prompt_file(
    model, tokenizer, tmp_path: Path, monkeypatch
) -> None:
    """``/save F`` over an existing file is refused unless ``--force``; ``/load`` of a file that
    ``cache-prompt`` wrote (a prompt, no conversation) is refused: it dropped the prompt before."""
    from mlxformer.generation.prompt_cache_files import cache_prompt

    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes").write_text("keep me")
    out = io.StringIO()
    run_repl(ChatSession(model, tokenizer, max_tokens=3), io.StringIO("Hi\n/save notes\n"), out)
    assert "notes already exists (use --force to overwrite)" in out.getvalue()
    assert (tmp_path / "notes").read_text() == "keep me"
    run_repl(ChatSession(model, tokenizer, max_tokens=3), io.StringIO("Hi\n/save notes --force\n/load notes\n"), out)
    assert "[saved " in out.getvalue() and "messages from notes]" in out.getvalue()
    ids = tokenizer.encode_prompt("Here is a document.", continue_final_message=True)
    cache_prompt(tmp_path / "doc", model, tokenizer, ids)
    out = io.StringIO()
    run_repl(ChatSession(model, tokenizer, max_tokens=3), io.StringIO("/load doc\n"), out)
    assert out.getvalue() == ("[error: doc holds a prompt saved by cache-prompt, not a conversation: use it with "
                              "'mlxformer generate --prompt-cache-file']\n")
