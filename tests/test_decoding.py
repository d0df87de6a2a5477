"""One decoding state under every loop: chat, cached prompts, bench and the engine speculate
over the whole history, keep the cache exactly in step with the tokens handed out, and give
the text of plain greedy decoding; plus the command-line defects of the same review.

A tiny random Llama with SmolLM2's tokenizer and chat template keeps this cheap. References: plain (non-speculative)
greedy decoding, which ``test_speculative``/``test_chat`` tie to transformers and uncached
generation; a self-draft (the target as its own draft) must accept every greedy proposal.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import mlx.core as mx
import pytest

from conftest import write_tiny_checkpoint
from mlxformer.generation.chat import ChatSession
from mlxformer.cli import main
from mlxformer.speculative.speculator import SpeculativeSettings

TURNS = [
    "Repeat this sentence exactly: The cat sat on the mat.",
    "What was the last word of your previous answer? Reply with that one word only.",
    "Repeat this sentence exactly: The dog ran in the park.",
    "Now say the first sentence again.",
]
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory, smollm_gguf):
    """Two tiny random Llamas with SmolLM2's tokenizer: head_dim 64 (the target) and 32 (a draft)."""
    from mlxformer import load

    tokenizer = load(smollm_gguf, threads=1)[1]
    dirs = []
    for name, head_dim, heads in (("target", 64, 4), ("draft32", 32, 2)):
        directory, _ = write_tiny_checkpoint(
            tmp_path_factory.mktemp(name), "llama", seed=3, vocab_size=49152, head_dim=head_dim,
            num_attention_heads=heads, num_key_value_heads=1 if heads == 2 else 2, tie_word_embeddings=True,
        )
        tokenizer.save(directory)
        dirs.append(directory)
    return dirs


@pytest.fixture(scope="module")
def tiny(tiny_dirs):
    from mlxformer import load

    return load(tiny_dirs[0], dtype=mx.float32, threads=1)


def run(capsys, *argv: str) -> tuple[str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    assert code == 0, err
    return out, err


def chat_turns(model, tokenizer, speculative=None, stop=(), max_tokens=16):
    """Each turn's text and (accepted, proposed) counts; asserts after every turn that the cache
    holds exactly the tokens the session says it holds."""
    session = ChatSession(model, tokenizer, max_tokens=max_tokens, stop=stop, speculative=speculative)
    texts, counts = [], []
    for turn in TURNS:
        responses = list(session.send(turn))
        texts.append("".join(r.text for r in responses))
        counts.append((responses[-1].accepted_tokens, responses[-1].proposed_tokens))
        assert all(int(c.offset) == len(session.cached_ids) for c in session.cache)
    return texts, counts


def test_chat_with_prompt_lookup_gives_the_plain_text(smollm):
    """The review's repro on the real model: a stop string inside accepted proposals left them
    in the cache (51 cached against 46 tokens in the conversation), corrupting the next turns."""
    model, tokenizer = smollm
    plain, _ = chat_turns(model, tokenizer, stop=[" on"], max_tokens=8)
    spoken, counts = chat_turns(model, tokenizer, SpeculativeSettings(8, prompt_lookup=True), [" on"], 8)
    assert spoken == plain
    assert sum(a for a, _ in counts) > 0, counts


def test_chat_with_a_self_draft_gives_the_plain_text_and_keeps_its_acceptance(tiny):
    """A draft that is the target accepts every greedy proposal on every turn when it sees the
    whole conversation (it accepted 31/31, then 2/43, then 0/44 seeing only the new turn); a
    stop string inside a round leaves the cache exact."""
    model, tokenizer = tiny
    first, _ = chat_turns(model, tokenizer, max_tokens=12)
    stop = [first[0][-8:-5]]  # hit inside a speculation round (every proposal is accepted)
    plain, _ = chat_turns(model, tokenizer, stop=stop, max_tokens=12)
    draft = SpeculativeSettings(4, draft_model=model, draft_tokenizer=tokenizer)
    spoken, counts = chat_turns(model, tokenizer, draft, stop, 12)
    assert spoken == plain and plain != first
    rates = [a / p for a, p in counts if p]
    assert len(rates) == 4 and all(abs(r - rates[0]) <= 0.1 * rates[0] for r in rates[1:]), counts


def test_generate_from_a_prompt_cache_file_speculates_over_the_whole_prompt(tiny_dirs, tmp_path, capsys):
    target = str(tiny_dirs[0])
    long = " ".join(TURNS * 3)
    cache_file = str(tmp_path / "prompt.safetensors")
    run(capsys, "cache-prompt", "--model", target, "--prompt", long, "--prompt-cache-file", cache_file)
    common = ("generate", "--model", target, "--prompt", long, "--prompt-cache-file", cache_file,
              "--max-tokens", "12", "--dtype", "float32")
    plain, _ = run(capsys, *common)
    drafted, err = run(capsys, *common, "--draft-model", target, "--verbose")
    assert drafted == plain
    accepted, proposed = map(int, err.split("accepted ")[1].split()[0].split("/"))
    assert proposed > 0 and accepted == proposed, err


def test_speculation_over_rotating_caches_made_by_bench_or_loaded_from_a_file(tiny_dirs, tmp_path, capsys):
    """The rewind slack comes with every cache that speculation runs over: bench's, and a
    rotating cache loaded from a file made without it (both failed: 'needs a KV cache that can rewind')."""
    target = str(tiny_dirs[0])
    out, _ = run(capsys, "bench", "--model", target, "--max-kv-size", "8", "--draft-model", target,
                 "--prompt-tokens", "16", "--generation-tokens", "8", "--trials", "1", "--json")
    median = json.loads(out)["median"]
    assert median["generation_tokens"] == 8 and median["accepted_tokens"] == median["proposed_tokens"] > 0
    cache_file = str(tmp_path / "rotating.safetensors")
    prompt = " ".join(TURNS)
    run(capsys, "cache-prompt", "--model", target, "--prompt", prompt, "--prompt-cache-file", cache_file,
        "--max-kv-size", "8")
    common = ("generate", "--model", target, "--prompt", prompt, "--prompt-cache-file", cache_file,
              "--max-tokens", "8", "--dtype", "float32")
    plain, _ = run(capsys, *common)
    assert run(capsys, *common, "--draft-model", target)[0] == plain
    assert run(capsys, *common, "--prompt-lookup")[0] == plain


def test_a_draft_gets_kv_settings_that_fit_it(tiny_dirs, capsys):
    """--kv-bits 8 (groups of 64) with a draft of head_dim 32: the draft keeps a float cache."""
    common = ("generate", "--model", str(tiny_dirs[0]), "--prompt", TURNS[0], "--max-tokens", "10", "--kv-bits", "8",
              "--dtype", "float32")
    plain, _ = run(capsys, *common)
    assert run(capsys, *common, "--draft-model", str(tiny_dirs[1]))[0] == plain


def test_a_stop_string_cutting_structured_output_warns(tiny_dirs, capsys):
    schema = json.dumps({"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]})
    common = ("generate", "--model", str(tiny_dirs[0]), "--prompt", "A person as JSON", "--json-schema", schema,
              "--max-tokens", "40")
    out, err = run(capsys, *common, "--stop", "name")
    assert out.lstrip().startswith("{") and "name" not in out
    assert "a --stop string cut the structured output short" in err
    out, err = run(capsys, *common, "--max-tokens", "3")
    assert "--max-tokens cut the structured output short" in err


def test_chat_repl_reports_os_errors_and_goes_on(tiny, tmp_path):
    from mlxformer.cli.chat import run_repl

    model, tokenizer = tiny
    session = ChatSession(model, tokenizer, max_tokens=4)
    lines = f"Hello\n/save {tmp_path}\n/save {tmp_path / 'missing' / 'chat'}\nHow are you?\n/stats\n"
    out = io.StringIO()
    run_repl(session, io.StringIO(lines), out)
    errors = [line for line in out.getvalue().splitlines() if line.startswith("[error:")]
    assert len(errors) == 2 and str(tmp_path / "missing") in errors[1], out.getvalue()
    assert len(session.messages) == 4  # both turns answered


def test_cache_prompt_into_a_missing_directory_fails_before_loading(tmp_path, capsys):
    target = tmp_path / "missing" / "prompt.safetensors"
    assert main(["cache-prompt", "--model", str(tmp_path / "no-model"), "--prompt", "hi",
                 "--prompt-cache-file", str(target)]) == 1
    err = capsys.readouterr().err
    assert str(tmp_path / "missing") in err and "no-model" not in err, err


def test_prompt_from_stdin_with_parallel_is_a_one_line_error(monkeypatch, capsys):
    class EndlessStdin(io.StringIO):
        def read(self, *args):  # mlx.launch never closes the ranks' stdin
            raise AssertionError("stdin was read")

    monkeypatch.setattr(sys, "stdin", EndlessStdin())
    assert main(["generate", "--parallel", "tensor", "--prompt", "-"]) == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "--prompt - is not supported with --parallel" in err


def test_perplexity_scores_every_token_once_when_the_stride_is_the_context(monkeypatch):
    import mlxformer.tools.perplexity as ppl

    scored = []
    monkeypatch.setattr(ppl, "window_negative_log_likelihood", lambda model, window, n: scored.append(n) or 0.0)
    for n_tokens, context, stride in ((100, 16, 16), (100, 16, 5), (17, 16, 16), (40, 2, 2)):
        scored.clear()
        ppl.perplexity(None, list(range(n_tokens)), context, stride)  # type: ignore[arg-type]
        assert sum(scored) == n_tokens - 1, (n_tokens, context, stride)


TENSOR_WATCHDOG = """
import sys, time
import mlx.core as mx
from mlxformer.distributed.runner import DistributedModel, stream_distributed
from mlxformer.distributed.tensor import load_tensor_shard
from mlxformer.distributed.watchdog import Watchdog
from mlxformer.formats.checkpoint import open_checkpoint
from mlxformer.loader import load_tokenizer

group = mx.distributed.init()  # one rank: every all_sum is a wait that returns at once
watchdog = Watchdog(0, timeout=2.0, poll=0.05)
reader = open_checkpoint(sys.argv[1])
model = load_tensor_shard(reader, group, None)
layer = model.layers[0]
forward = type(layer).__call__
def slow(self, x, *args, **kwargs):  # this rank's own compute: the prompt 2.5 s (longer than one timeout), a step 0.5 s
    time.sleep((2.5 if x.shape[1] > 1 else 0.5) if self is layer else 0.0)
    return forward(self, x, *args, **kwargs)
type(layer).__call__ = slow
dist = DistributedModel(group, "tensor", model, load_tokenizer(reader), watchdog)
print(len(list(stream_distributed(dist, [1, 2, 3, 4], 3))))
"""


def test_tensor_parallel_watchdog_guards_each_step_and_gives_the_prompt_more(tiny_dirs):
    """The watchdog's countdown runs once per step (the sums are in the step's graph): a step
    under the timeout passes, and the first (the prompt's chunks then a step) gets a timeout per
    chunk more."""
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(TENSOR_WATCHDOG), str(tiny_dirs[0])], capture_output=True, text=True,
        timeout=120, env={**__import__("os").environ, "PYTHONPATH": str(REPO)},
    )
    assert result.returncode == 0 and result.stdout.strip() == "3", result.stderr
