"""``perplexity`` against the Hugging Face strided-evaluation recipe run in transformers, and the CLI."""

from __future__ import annotations

import math
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from conftest import write_tiny_checkpoint
from mlxformer import load
from mlxformer.cli import main as cli_main
from mlxformer.errors import MlxformerError
from mlxformer.tools.perplexity import cached_perplexity, perplexity

EVAL_TEXT = Path(__file__).resolve().parent / "data/eval.txt"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    directory, hf_model = write_tiny_checkpoint(tmp_path_factory.mktemp("ppl_tiny"), "llama", seed=5)
    _write_letter_tokenizer(directory)
    model, _ = load(directory, dtype=mx.float32)
    return directory, hf_model, model


def _write_letter_tokenizer(directory: Path) -> None:
    """A word-level tokenizer over single letters (ids < 26), made with ``tokenizers``."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {chr(ord("a") + i): i for i in range(26)} | {"[UNK]": 26}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(directory / "tokenizer.json"))


def hf_strided_perplexity(hf_model, ids: list[int], context: int, stride: int) -> float:
    """The transformers documentation's sliding-window loop (labels -100 for already-scored tokens)."""
    import torch

    seq = torch.tensor([ids])
    nll, count, prev_end = 0.0, 0, 0
    for begin in range(0, seq.shape[1], stride):
        end = min(begin + context, seq.shape[1])
        target_len = end - prev_end
        inputs = seq[:, begin:end]
        labels = inputs.clone()
        labels[:, :-target_len] = -100
        with torch.no_grad():
            logits = hf_model(inputs).logits.float()
        shift_logits, shift_labels = logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1)
        nll += torch.nn.functional.cross_entropy(shift_logits, shift_labels, ignore_index=-100, reduction="sum").item()
        count += int((shift_labels != -100).sum())
        prev_end = end
        if end == seq.shape[1]:
            break
    return math.exp(nll / count)


# stride == context is left out: transformers' loop then skips each window's first token, while
# mlxformer scores every token exactly once (test_decoding checks that count)
@pytest.mark.parametrize("context,stride", [(64, 32), (50, 17), (300, 128)])
def test_matches_transformers_strided_loop(tiny, context, stride):
    _, hf_model, model = tiny
    ids = [int(i) for i in np.random.default_rng(context + stride).integers(0, 256, size=200)]
    ours = perplexity(model, ids, context, stride)
    assert ours == pytest.approx(hf_strided_perplexity(hf_model, ids, context, stride), rel=1e-4)


def test_known_answer_for_a_uniform_model():
    class Uniform:
        def __call__(self, tokens: mx.array) -> mx.array:
            return mx.zeros((*tokens.shape, 10))

    assert perplexity(Uniform(), list(range(10)) * 5, context=8, stride=3) == pytest.approx(10.0, rel=1e-5)


def test_a_large_vocabulary_equals_a_float64_reference():
    """A bigram model over 49,152 tokens (SmolLM2's vocabulary size: where MLX's CPU
    ``mx.logsumexp`` is ~1e-4 low, every log-prob that much high): the windowed and the cached
    perplexity equal numpy's float64 one within 2e-6 of its log."""
    from conftest import log_softmax

    vocab, rng = 49152, np.random.default_rng(3)
    table = rng.normal(0, 4, (64, vocab)).astype(np.float32)  # next-token logits after each token
    ids = [int(i) for i in rng.integers(0, 64, size=120)]
    nll = -log_softmax(table[ids[:-1]])[np.arange(len(ids) - 1), ids[1:]]
    exact = float(nll.mean())
    bigram = mx.array(table)

    def model(tokens: mx.array, cache=None) -> mx.array:
        return bigram[tokens]  # (1, T, vocab)

    assert math.log(perplexity(model, ids, context=50, stride=20)) == pytest.approx(exact, abs=2e-6)
    assert math.log(cached_perplexity(model, [], ids, chunk=32)) == pytest.approx(exact, abs=2e-6)


def test_bad_window_settings_raise():
    with pytest.raises(MlxformerError):
        perplexity(lambda t: t, [1, 2, 3], context=1, stride=1)
    with pytest.raises(MlxformerError):
        perplexity(lambda t: t, [1, 2, 3], context=8, stride=9)


def test_cli_prints_tokens_perplexity_and_time(tiny, tmp_path, capsys):
    directory = tiny[0]
    text = tmp_path / "t.txt"
    text.write_text(" ".join(chr(ord("a") + i % 26) for i in range(300)))
    code = cli_main(["perplexity", "--model", str(directory), "--text", str(text), "--context", "64", "--stride", "32"])
    out = capsys.readouterr().out
    assert code == 0, out
    lines = dict(line.split(": ", 1) for line in out.strip().splitlines())
    assert int(lines["tokens"]) > 64 and float(lines["perplexity"]) > 1 and lines["time"].endswith("tokens/s)")


def test_cli_refuses_missing_text(tiny, capsys):
    code = cli_main(["perplexity", "--model", str(tiny[0]), "--text", "/nonexistent.txt"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1 and "cannot read text" in err[0]
