"""SentencePiece-only model dirs with added tokens (chat tokens, an EOS that is an added token).

Before: ``added_tokens.json`` / ``added_tokens_decoder`` were never read, so `<|im_end|>` was
spelled as bytes, the model had no EOS (generation never stopped) and the ids decoded to "".
Reference: transformers' ``AutoTokenizer`` on the same dir; for a model transformers cannot
convert faithfully (unigram, NFKC), `sentencepiece` with the tokens trained in as user symbols.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from mlxformer.errors import MlxformerError
from mlxformer.text.tokenizer import load_tokenizer_from_dir

CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
TEXTS = [
    "<|im_start|>user\nthe of<|im_end|>\n<|im_start|>assistant\n", "a <|im_end|> b", "<tool>the</tool>",
    "the <s> of </s>", "no added tokens: café über", "<|im_start|><|im_end|><|im_start|>",
]


def _corpus() -> list[str]:
    rng = random.Random(0)
    words = "the of and a to in is you that it he was for on are as with his they at be this from".split()
    words += "café naïve über façade 日本 中文".split()
    return [" ".join(rng.choice(words) for _ in range(rng.randint(5, 15))) for _ in range(400)]


def _train(out: Path, **options) -> int:
    import sentencepiece as spm

    spm.SentencePieceTrainer.train(sentence_iterator=iter(_corpus()), model_prefix=str(out / "tokenizer"),
                                   vocab_size=300, byte_fallback=True, minloglevel=2, **options)
    return spm.SentencePieceProcessor(model_file=str(out / "tokenizer.model")).get_piece_size()


@pytest.fixture(scope="module", params=["added_tokens_decoder", "added_tokens.json"])
def llama_dir(request, tmp_path_factory) -> Path:
    """A Llama-style SentencePiece (BPE, identity, whitespace kept) whose chat tokens and EOS
    are added tokens, declared either way transformers reads."""
    out = tmp_path_factory.mktemp("spm_added")
    n = _train(out, model_type="bpe", normalization_rule_name="identity", remove_extra_whitespaces=False)
    config = dict(tokenizer_class="LlamaTokenizer", bos_token="<s>", eos_token="<|im_end|>", unk_token="<unk>",
                  add_bos_token=True, add_eos_token=False, legacy=False, chat_template=CHATML)
    added = {"<|im_start|>": n, "<|im_end|>": n + 1, "<tool>": n + 2}
    if request.param == "added_tokens_decoder":
        config["added_tokens_decoder"] = {
            str(i): {"content": t, "special": t != "<tool>", "lstrip": False, "rstrip": False,
                     "normalized": False, "single_word": False}
            for t, i in added.items()
        }
    else:
        config["additional_special_tokens"] = ["<|im_start|>"]
        (out / "added_tokens.json").write_text(json.dumps(added))
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


def test_added_tokens_match_transformers(llama_dir):
    from transformers import AutoTokenizer

    ours, ref = load_tokenizer_from_dir(llama_dir), AutoTokenizer.from_pretrained(str(llama_dir))
    assert ours.vocab_size == len(ref) == 303
    assert ours.eos_token_ids == [ref.eos_token_id] == [301]  # generation stops on the added EOS
    for text in TEXTS:
        for add in (True, False):
            assert ours.encode(text, add_special_tokens=add) == ref.encode(text, add_special_tokens=add), (text, add)
        ids = ours.encode(text)
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip), (text, skip)
    assert ours.decode([300, 301, 302]) == "<|im_start|><|im_end|><tool>"
    messages = [{"role": "user", "content": "the of"}]
    prompt = ours.encode(ours.apply_chat_template(messages), add_special_tokens=False)
    assert prompt == list(ref.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))
    assert prompt.count(300) == 2 and prompt.count(301) == 1


def test_saved_dir_keeps_the_added_tokens(llama_dir, tmp_path):
    from transformers import AutoTokenizer

    ours = load_tokenizer_from_dir(llama_dir)
    ours.save(tmp_path)
    again, ref = load_tokenizer_from_dir(tmp_path), AutoTokenizer.from_pretrained(str(tmp_path))
    for text in TEXTS:
        assert again.encode(text) == ours.encode(text) == ref.encode(text), text
    assert again.eos_token_ids == ours.eos_token_ids


def test_sentencepiece_backend_reads_added_tokens(tmp_path):
    """A unigram NFKC model, which transformers' BPE conversion would not reproduce, is run by
    sentencepiece itself: the added chat tokens are matched whole under their ids (known answers:
    each alone is its id, text round-trips, the added EOS ends generation)."""
    n = _train(tmp_path, model_type="unigram")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    (tmp_path / "added_tokens.json").write_text(json.dumps({"<|im_start|>": n, "<|im_end|>": n + 1}))
    ours = load_tokenizer_from_dir(tmp_path)
    assert type(ours.backend).__name__ == "SPMBackend"
    assert ours.eos_token_ids == [n + 1] and ours.vocab_size == n + 2
    assert ours.encode("<|im_start|>", add_special_tokens=False)[-1] == n
    assert ours.encode("<|im_end|>", add_special_tokens=False)[-1] == n + 1
    for text in TEXTS[:2] + ["<|im_start|>the<|im_end|>of"]:
        ids = ours.encode(text, add_special_tokens=False)
        assert ids.count(n) == text.count("<|im_start|>") and ids.count(n + 1) == text.count("<|im_end|>")
        assert ours.decode(ids) == text.replace("\n", " ").strip() or ours.decode(ids) == text
    assert ours.decode([n, n + 1]) == "<|im_start|><|im_end|>"
    assert ours.decode([n, n + 1], skip_special_tokens=True) == "<|im_start|>"  # only the EOS is special


def test_bad_added_tokens_are_one_line_errors(llama_dir, tmp_path):
    import shutil

    shutil.copy(llama_dir / "tokenizer.model", tmp_path / "tokenizer.model")
    (tmp_path / "added_tokens.json").write_text(json.dumps({"<|gap|>": 400}))
    with pytest.raises(MlxformerError, match="next free id is 300"):
        load_tokenizer_from_dir(tmp_path)
    (tmp_path / "added_tokens.json").write_text(json.dumps({"<|x|>": "300"}))
    with pytest.raises(MlxformerError, match="added_tokens.json: the id of '<|x|>'"):
        load_tokenizer_from_dir(tmp_path)
