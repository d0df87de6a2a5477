"""Speculative decoding: greedy output identical to plain decoding for every family, cache kind
and proposer; sampled tokens distributed as the target's exact distribution (chi-square); the
CLI flags, statistics and refusals."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from scipy import stats as scipy_stats

from conftest import write_tiny_checkpoint
from mlxformer import load, stream_generate
from mlxformer.cache import CacheSettings
from mlxformer.cli import main
from mlxformer.errors import MlxformerError
from mlxformer.speculative.speculator import AdaptiveLength, PromptLookupProposer, SpeculativeSettings

# head_dim 64 so that the quantized KV cache (group 64) applies
SHAPE = dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=64, intermediate_size=128)


def write_word_tokenizer(directory: Path, vocab_size: int) -> None:
    """A word-level tokenizer.json over the tokens ``w0 .. w{vocab_size - 1}``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab_size)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##")
    tokenizer.save(str(directory / "tokenizer.json"))


def tiny(directory: Path, model_type: str, seed: int = 0, vocab_size: int = 256, **config):
    write_tiny_checkpoint(directory, model_type, seed=seed, vocab_size=vocab_size, **{**SHAPE, **config})
    write_word_tokenizer(directory, vocab_size)
    model, tokenizer = load(directory, threads=1, dtype=mx.float32)  # float32 on any device (a GPU would pick bfloat16)
    tokenizer.eos_token_ids = []  # random weights: never stop early, every run has all its tokens
    return model, tokenizer


@pytest.fixture(scope="module")
def family_models(tmp_path_factory):
    """(target, draft of the same vocabulary with other weights) for each family."""
    out = {}
    for model_type in ("llama", "mistral", "qwen2", "qwen3"):
        target = tiny(tmp_path_factory.mktemp(model_type), model_type, seed=0)
        draft = tiny(tmp_path_factory.mktemp(f"{model_type}-draft"), model_type, seed=1, num_hidden_layers=1)
        out[model_type] = (target, draft)
    return out


# A prompt with repeats, so that prompt lookup finds n-grams to propose.
PROMPT = [5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 11, 12, 5, 6, 7, 8, 9, 13, 5, 6, 7]

CACHES = {
    "float": None,
    "kv8": CacheSettings(kv_bits=8),
    "kv4": CacheSettings(kv_bits=4),
    "rotating": CacheSettings(max_kv_size=24),  # the prompt plus 40 tokens overflow it: evictions happen
}


def tokens_of(model, tokenizer, speculative=None, settings=None, max_tokens=40, prompt=PROMPT, **sampling):
    responses = list(stream_generate(
        model, tokenizer, prompt, max_tokens, cache_settings=settings, speculative=speculative, **sampling
    ))
    return [r.token for r in responses], responses[-1]


@pytest.mark.parametrize("cache_name", list(CACHES))
@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2", "qwen3"])
def test_greedy_output_is_plain_output(family_models, model_type, cache_name):
    (model, tokenizer), (draft, draft_tokenizer) = family_models[model_type]
    settings = CACHES[cache_name]
    plain, _ = tokens_of(model, tokenizer, settings=settings)
    proposers = {
        # a random model rarely repeats a 2-gram of the prompt: let single tokens propose
        "lookup": SpeculativeSettings(prompt_lookup=True, num_draft_tokens=5, ngram_min=1),
        "self-draft": SpeculativeSettings(draft_model=model, draft_tokenizer=tokenizer, num_draft_tokens=3),
        "other-draft": SpeculativeSettings(draft_model=draft, draft_tokenizer=draft_tokenizer, num_draft_tokens=3),
    }
    accepted = {}
    for name, speculative in proposers.items():
        got, last = tokens_of(model, tokenizer, speculative, settings)
        assert got == plain, name
        assert last.proposed_tokens > 0, name
        accepted[name] = last.accepted_tokens / last.proposed_tokens
    # The target drafting for itself proposes what it would decode: (nearly) all accepted,
    # so the multi-token verification path is exercised, not only rejections.
    assert accepted["self-draft"] > 0.8


def test_greedy_identity_on_the_real_model(smollm):
    model, tokenizer = smollm
    text = ("The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. "
            "How vexingly quick daft zebras jump!")
    prompt = tokenizer.encode_prompt(f"Repeat this text exactly: {text}")
    plain, _ = tokens_of(model, tokenizer, max_tokens=24, prompt=prompt)
    got, last = tokens_of(model, tokenizer, SpeculativeSettings(prompt_lookup=True, num_draft_tokens=8),
                          max_tokens=24, prompt=prompt)
    assert got == plain
    assert last.accepted_tokens >= 8  # copying a text: most proposals hold


def exact_second_token_marginal(model, prompt: list[int], temp: float) -> np.ndarray:
    """p(t2) = sum over t1 of p(t1 | prompt) p(t2 | prompt, t1), at temperature ``temp``."""
    first = mx.softmax(model(mx.array([prompt]))[0, -1].astype(mx.float32) / temp)  # (vocab,)
    vocab = first.shape[0]
    batch = mx.concatenate([mx.broadcast_to(mx.array(prompt), (vocab, len(prompt))), mx.arange(vocab)[:, None]], axis=1)
    second = mx.softmax(model(batch)[:, -1].astype(mx.float32) / temp, axis=-1)  # (vocab, vocab)
    return np.array(first[:, None] * second).sum(axis=0).astype(np.float64)


def chi_square_p_value(samples: list[int], expected_probs: np.ndarray) -> float:
    """Goodness of fit of ``samples`` to ``expected_probs``, pooling cells expected below 5."""
    n = len(samples)
    observed = np.bincount(samples, minlength=len(expected_probs)).astype(np.float64)
    expected = expected_probs / expected_probs.sum() * n
    big = expected >= 5
    obs = np.append(observed[big], observed[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return float(scipy_stats.chisquare(obs, exp).pvalue)


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory):
    target = tiny(tmp_path_factory.mktemp("sv"), "llama", seed=3, vocab_size=24, num_hidden_layers=1)
    draft = tiny(tmp_path_factory.mktemp("sv-draft"), "llama", seed=4, vocab_size=24, num_hidden_layers=1)
    return target, draft


SAMPLES = 1200
SV_PROMPT = [3, 4, 5, 3, 4, 5, 3, 4]


@pytest.mark.parametrize("proposer", ["draft", "lookup"])
def test_sampled_tokens_follow_the_target_distribution(small_vocab, proposer):
    (model, tokenizer), (draft, draft_tokenizer) = small_vocab
    speculative = (
        SpeculativeSettings(draft_model=draft, draft_tokenizer=draft_tokenizer, num_draft_tokens=2)
        if proposer == "draft" else SpeculativeSettings(prompt_lookup=True, num_draft_tokens=2, ngram_min=1)
    )
    second = []
    rounds_with_rejection = 0
    for seed in range(SAMPLES):
        tokens, last = tokens_of(model, tokenizer, speculative, max_tokens=4, prompt=SV_PROMPT, temp=1.0, seed=seed)
        second.append(tokens[1])
        rounds_with_rejection += last.accepted_tokens < last.proposed_tokens
    exact = exact_second_token_marginal(model, SV_PROMPT, 1.0)
    assert chi_square_p_value(second, exact) > 1e-3
    assert rounds_with_rejection > SAMPLES // 10  # the rejection branch was exercised
    # The test has power: the same samples do not fit the draft model's own distribution.
    if proposer == "draft":
        assert chi_square_p_value(second, exact_second_token_marginal(draft, SV_PROMPT, 1.0)) < 1e-3


def test_plain_sampling_fits_the_same_reference(small_vocab):
    """The reference itself is right: plain sampling fits it too."""
    (model, tokenizer), _ = small_vocab
    second = [tokens_of(model, tokenizer, max_tokens=2, prompt=SV_PROMPT, temp=1.0, seed=s)[0][1] for s in range(SAMPLES)]
    assert chi_square_p_value(second, exact_second_token_marginal(model, SV_PROMPT, 1.0)) > 1e-3


def test_prompt_lookup_proposes_what_followed_the_longest_match():
    lookup = PromptLookupProposer(ngram_max=3, ngram_min=1)
    history = [1, 2, 3, 4, 5, 9, 2, 3, 7, 1, 2, 3]
    assert lookup.propose(history, 3) == ([4, 5, 9], None)  # [1,2,3] matched at 0
    assert lookup.propose([1, 2, 3, 2, 3], 2) == ([2, 3], None)  # [2,3] most recent earlier match
    assert lookup.propose([1, 2, 3], 4) == ([], None)
    assert lookup.propose([1, 2, 3, 9, 3], 2) == ([9, 3], None)  # a single recurring token (n = 1)
    assert PromptLookupProposer().propose([1, 2, 3, 9, 3], 2) == ([], None)  # the default needs n >= 2


def test_adaptive_length():
    length = AdaptiveLength(limit=4)
    assert length.current == 4
    length.update(1, 4)
    assert length.current == 3
    length.update(0, 3)
    length.update(0, 2)
    length.update(0, 1)
    assert length.current == 1
    length.update(1, 1)
    assert length.current == 2


def test_draft_with_another_tokenizer_is_refused(family_models, tmp_path):
    (model, tokenizer), _ = family_models["llama"]
    other = tiny(tmp_path, "llama", vocab_size=200)
    speculative = SpeculativeSettings(draft_model=other[0], draft_tokenizer=other[1])
    with pytest.raises(MlxformerError, match="tokenizer differs"):
        tokens_of(model, tokenizer, speculative)


def test_settings_are_checked():
    with pytest.raises(MlxformerError):
        SpeculativeSettings()  # neither lookup nor draft
    with pytest.raises(MlxformerError):
        SpeculativeSettings(prompt_lookup=True, num_draft_tokens=0)


def test_cli_prompt_lookup_and_draft(family_models, tmp_path, capsys):
    directory = tmp_path / "m"
    tiny(directory, "llama")
    prompt = " ".join(f"w{t}" for t in PROMPT)
    assert main(["generate", "--model", str(directory), "--prompt", prompt, "--ignore-chat-template",
                 "--max-tokens", "20"]) == 0
    plain = capsys.readouterr().out
    assert main(["generate", "--model", str(directory), "--prompt", prompt, "--ignore-chat-template",
                 "--max-tokens", "20", "--prompt-lookup", "--num-draft-tokens", "6", "-v"]) == 0
    captured = capsys.readouterr()
    assert captured.out == plain
    assert "speculative: accepted" in captured.err
    assert main(["generate", "--model", str(directory), "--prompt", prompt, "--ignore-chat-template",
                 "--max-tokens", "20", "--draft-model", str(directory)]) == 0
    assert capsys.readouterr().out == plain
    assert main(["bench", "--model", str(directory), "--prompt-tokens", "16", "--generation-tokens", "8",
                 "--trials", "1", "--draft-model", str(directory), "--json"]) == 0
    assert '"proposed_tokens"' in capsys.readouterr().out
    assert main(["generate", "--model", str(directory), "--prompt", prompt, "--num-draft-tokens", "3"]) == 1
    assert "needs --prompt-lookup, --draft-model or --mtp" in capsys.readouterr().err
