"""The real SmolLM2-135M-Instruct (Q4_1 GGUF, and the same model in HF layout) against transformers."""

from __future__ import annotations

import os
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest
import torch

from mlxformer import load, stream_generate

# No whitespace run directly before a digit: there transformers' GGUF tokenizer drops SmolLM2's
# digit pre-split (see tests/test_tokenizer.py, which documents that divergence).
CORPUS = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "Café naïve résumé façade Ångström Straße señor über",
    "Emoji: 😀 🎉 👍🏽 👨‍👩‍👧‍👦 🧑🏻‍💻 ❤️",
    "日本語のテキストです。中文文本，한국어 텍스트",
    "Numbers: 0 7 42 1234567890 3.14159265358979 1,000,000 -273.15 2024-01-31",
    "tabs\tand\t\ttabs\nnewlines\n\n\nand   spaces     here   ",
    "def f(x: int) -> int:\n    return x ** 2  # square\n\nprint(f(3))\n",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
]
MESSAGES = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three colours."}],
    [{"role": "user", "content": "What is 2+2? Answer with a number only."}],
]
# Two answers end on eos within 16 tokens (after 8 and 13), the haiku runs to the limit: both endings are compared.
GREEDY_TOKENS = 16
GREEDY_MESSAGES = MESSAGES[:2] + [[{"role": "user", "content": "Write a haiku about the sea."}]]
TEXT = (
    "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. "
    "It is named after the engineer Gustave Eiffel, whose company designed and built the tower "
    "from 1887 to 1889. Locally nicknamed \"La dame de fer\", it was constructed as the centrepiece "
    "of the 1889 World's Fair."
)
# Both sides compute from identical dequantized weights in float32 (Q4_1 dequantization is exact
# in fp32, and the HF-layout copy is cast from bf16 to fp32 on both sides); they differ only in
# fp32 summation order, compounded over 30 layers and a 49152-way log-softmax. Measured 1e-4
# (GGUF) and 5e-4 (HF layout) on these sequences; 2e-3 leaves margin while a single wrong
# weight/rope/norm shifts log-probs by O(1).
LOGPROB_BOUND = 2e-3
ARGMAX_AGREEMENT = 0.99


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def sequences(tokenizer) -> list[list[int]]:
    """32 tokens of natural text and 16 random token ids. Only 48 positions: MLX's CPU matmul is
    slow here (~1-2 GFLOP/s), ~5 s per 48-token forward of this model on the shared 2-core box."""
    natural = tokenizer.encode(TEXT)[:32]
    rng = np.random.default_rng(0)
    return [natural, [int(t) for t in rng.integers(0, 49152, size=16)]]


def compare_logits(ours_model, hf_model, seqs: list[list[int]]) -> None:
    diffs, agree, total = [], 0, 0
    for ids in seqs:
        got = np.array(ours_model(mx.array([ids]))[0].astype(mx.float32))
        with torch.no_grad():
            ref = hf_model(torch.tensor([ids])).logits[0].float().numpy()
        assert got.shape == ref.shape
        diffs.append(float(np.abs(log_softmax(got) - log_softmax(ref)).max()))
        agree += int((got.argmax(-1) == ref.argmax(-1)).sum())
        total += len(ids)
    assert max(diffs) <= LOGPROB_BOUND, diffs
    assert agree / total >= ARGMAX_AGREEMENT, (agree, total)


# ---------------------------------------------------------------- GGUF


def test_gguf_token_ids_match_transformers(smollm, hf_smollm_tokenizer):
    _, ours = smollm
    for text in CORPUS:
        for special in (True, False):
            assert ours.encode(text, add_special_tokens=special) == hf_smollm_tokenizer.encode(
                text, add_special_tokens=special
            ), text
        ids = hf_smollm_tokenizer.encode(text, add_special_tokens=False)
        assert ours.decode(ids) == hf_smollm_tokenizer.decode(ids), text


@pytest.mark.parametrize("messages", MESSAGES, ids=range(len(MESSAGES)))
def test_gguf_chat_template_matches_transformers(smollm, hf_smollm_tokenizer, messages):
    _, ours = smollm
    ref = hf_smollm_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert ours.apply_chat_template(messages, add_generation_prompt=True) == ref


def test_gguf_logits_match_transformers(smollm, hf_smollm):
    model, tokenizer = smollm
    # The CPU policy for quantized models: float32 activations, norms and embedding; quantized
    # linear layers keep their GGUF float16 scales (quantized_matmul widens them exactly).
    assert model.model.norm.weight.dtype == mx.float32
    assert model.model.embed_tokens.scales.dtype == mx.float32
    assert model.model.layers[0].mlp.down_proj.scales.dtype == mx.float16
    assert model(mx.array([[1, 2, 3]])).dtype == mx.float32
    compare_logits(model, hf_smollm, sequences(tokenizer))


def _hf_greedy(hf_model, ids: list[int], max_new: int, eos: list[int]) -> list[int]:
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=max_new, do_sample=False, eos_token_id=eos, pad_token_id=eos[0])
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([ids]), generation_config=config, attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    return out[0, len(ids):].tolist()


def test_gguf_greedy_continuations_match_transformers(smollm, hf_smollm, hf_smollm_tokenizer):
    model, tokenizer = smollm
    eos = list(tokenizer.eos_token_ids)
    assert eos == [hf_smollm_tokenizer.convert_tokens_to_ids("<|im_end|>")]
    endings = set()
    for messages in GREEDY_MESSAGES:
        ids = tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True), add_special_tokens=False)
        ref = _hf_greedy(hf_smollm, ids, GREEDY_TOKENS, eos)
        responses = list(stream_generate(model, tokenizer, ids, GREEDY_TOKENS, temp=0.0))
        assert [r.token for r in responses] == ref, messages
        if ref[-1] in eos:
            assert responses[-1].finish_reason == "stop"
        else:
            assert len(ref) == GREEDY_TOKENS and responses[-1].finish_reason == "length"
        endings.add(responses[-1].finish_reason)
        # generate() is the join of these pieces; the text is transformers' decode of the same ids.
        expected_text = hf_smollm_tokenizer.decode([t for t in ref if t not in eos])
        assert "".join(r.text for r in responses) == expected_text
    assert endings == {"stop", "length"}  # eos and max-tokens endings both exercised


def test_cli_generate_paris():
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        ["mlxformer", "generate", "--prompt", "What is the capital of France?", "--temp", "0", "--max-tokens", "32"],
        capture_output=True, text=True, env=env, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout
    assert "Paris" not in proc.stderr and "tok/s" not in proc.stdout
    assert "prompt:" in proc.stderr and "tok/s" in proc.stderr and "generation:" in proc.stderr


# ---------------------------------------------------------------- HF layout (bf16 safetensors)


@pytest.fixture(scope="module")
def hf_dir_pair(smollm_hf_dir):
    """(our load of the HF-layout dir, transformers float32 load of the same dir)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tokenizer = load(smollm_hf_dir)
    ref_model = AutoModelForCausalLM.from_pretrained(smollm_hf_dir, dtype=torch.float32).eval()
    ref_tokenizer = AutoTokenizer.from_pretrained(smollm_hf_dir)
    return model, tokenizer, ref_model, ref_tokenizer


def test_hf_dir_logits_match_transformers(hf_dir_pair):
    model, tokenizer, ref_model, _ = hf_dir_pair
    assert model.model.embed_tokens.weight.dtype == mx.bfloat16  # load keeps the checkpoint's dtype
    model.set_dtype(mx.float32)  # same bf16-rounded values, computed in fp32 on both sides
    assert model.model.embed_tokens.weight.dtype == mx.float32
    compare_logits(model, ref_model, sequences(tokenizer))


def test_hf_dir_token_ids_and_template_match_transformers(hf_dir_pair):
    _, tokenizer, _, ref_tokenizer = hf_dir_pair
    for text in CORPUS + ["x  1", "gap   3456"]:  # same tokenizer.json on both sides: digits too
        assert tokenizer.encode(text) == ref_tokenizer.encode(text), text
    ref = ref_tokenizer.apply_chat_template(MESSAGES[1], add_generation_prompt=True, tokenize=False)
    assert tokenizer.apply_chat_template(MESSAGES[1], add_generation_prompt=True) == ref
    assert tokenizer.eos_token_ids == [ref_tokenizer.convert_tokens_to_ids("<|im_end|>")]
