"""Token masks of the structured-output constraint, for every tokenizer kind, against an
independent check: each token's bytes come from the tokenizer's own vocabulary (GPT-2's byte map
from transformers, ``<0xNN>`` pieces, ``▁`` spaces), and a token must be allowed exactly when
the bytes so far plus its bytes are still a prefix of the language (the ``regex`` module's
partial matching). Where the grammar forces the next bytes, llguidance allows only the canonical
tokenization of the forced text: there the mask must be a non-empty subset of the valid tokens.
JSON random walks must end in documents that ``jsonschema`` accepts."""

from __future__ import annotations

import json
import pathlib
import random
from typing import Callable

import jsonschema
import mlx.core as mx
import numpy as np
import pytest
import regex

from mlxformer.constrained import make_constraint
from mlxformer.errors import MlxformerError
from mlxformer.text.tokenizer import Tokenizer, load_tokenizer_from_dir, load_tokenizer_from_gguf

WORDS = ["the", "über", "naïve", "日本", "Ω", "😀", "and", "of"]
# Ω and 😀 are rare in the corpus: SentencePiece must spell them with <0xNN> byte-fallback tokens.
PATTERN = r"(?:the|über|naïve|日本|(?:Ω)+|😀) [0-9]{1,3}(?:, (?:the|über|naïve|日本|(?:Ω)+|😀) [0-9]{1,3}){0,2}"
BYTES_PATTERN = regex.compile(PATTERN.encode("utf-8"))  # every non-ASCII char is a literal inside a group
PADDING = 13  # model rows past the tokenizer's last id


def _corpus() -> list[str]:
    rng = random.Random(0)
    common = [w for w in WORDS if w not in ("Ω", "😀")] + ["is", "a", "to", "in", "12", "345", "7", ",", "{", "}", '"']
    return [", ".join(f"{rng.choice(common)} {rng.randint(0, 999)}" for _ in range(rng.randint(2, 6))) for _ in range(400)]


def _byte_level_dir(out: pathlib.Path) -> pathlib.Path:
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=420, special_tokens=["<|endoftext|>", "<|pad|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(_corpus(), trainer)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>", "pad_token": "<|pad|>"}))
    return out


def _spm_dir(out: pathlib.Path) -> pathlib.Path:
    import sentencepiece as spm

    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(_corpus()), model_prefix=str(out / "tokenizer"), vocab_size=300,
        model_type="bpe", byte_fallback=True, character_coverage=0.999, minloglevel=2,
    )
    return out


def _spm_gguf(spm_dir: pathlib.Path, out: pathlib.Path) -> pathlib.Path:
    import gguf
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(spm_dir / "tokenizer.model"))
    n = sp.get_piece_size()
    writer = gguf.GGUFWriter(str(out / "spm.gguf"), "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list([sp.id_to_piece(i) for i in range(n)])
    writer.add_token_scores([sp.get_score(i) for i in range(n)])
    writer.add_token_types([2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6 if sp.is_byte(i) else 1
                            for i in range(n)])
    writer.add_bos_token_id(sp.bos_id())
    writer.add_eos_token_id(sp.eos_id())
    writer.add_unk_token_id(sp.unk_id())
    writer.add_tensor("dummy", np.zeros(4, dtype="float32"))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out / "spm.gguf"


def _gpt2_bytes(tok: Tokenizer) -> Callable[[int], bytes | None]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    decoder = {c: b for b, c in bytes_to_unicode().items()}
    special = {i for i, t in tok.backend.tok.get_added_tokens_decoder().items() if t.special}
    return lambda i: None if i in special else bytes(decoder[c] for c in tok.backend.id_to_token(i))


def _piece_bytes(is_special: Callable[[int], bool], piece: Callable[[int], str]) -> Callable[[int], bytes | None]:
    def token_bytes(i: int) -> bytes | None:
        if is_special(i):
            return None
        p = piece(i)
        if regex.fullmatch(r"<0x[0-9A-F]{2}>", p):
            return bytes([int(p[3:5], 16)])
        return p.replace("\u2581", " ").encode("utf-8")

    return token_bytes


@pytest.fixture(scope="module", params=["tokenizer.json", "sentencepiece", "gguf-llama", "gguf-gpt2"])
def vocab(request, tmp_path_factory, smollm_gguf) -> tuple[Tokenizer, Callable[[int], bytes | None]]:
    """(tokenizer, independent token id -> bytes, None for special tokens) for each tokenizer kind."""
    kind = request.param
    if kind == "tokenizer.json":
        tok = load_tokenizer_from_dir(_byte_level_dir(tmp_path_factory.mktemp("bytelevel")))
        return tok, _gpt2_bytes(tok)
    if kind == "gguf-gpt2":  # the real SmolLM2 vocabulary (49152 tokens)
        tok = load_tokenizer_from_gguf(mx.load(str(smollm_gguf), return_metadata=True)[1])
        return tok, _gpt2_bytes(tok)
    spm_dir = _spm_dir(tmp_path_factory.mktemp("spm"))
    if kind == "sentencepiece":
        tok = load_tokenizer_from_dir(spm_dir)
        sp = tok.backend.sp
        return tok, _piece_bytes(lambda i: sp.is_control(i) or sp.is_unknown(i), sp.id_to_piece)
    tok = load_tokenizer_from_gguf(mx.load(str(_spm_gguf(spm_dir, tmp_path_factory.mktemp("gguf"))),
                                           return_metadata=True)[1])
    special = {i for i, t in tok.backend.tok.get_added_tokens_decoder().items() if t.special}
    return tok, _piece_bytes(special.__contains__, tok.backend.id_to_token)


def _expected(prefix: bytes, candidates: dict[int, bytes], eos: set[int]) -> tuple[set[int], bool]:
    """(tokens that keep ``prefix`` a prefix of the language, plus EOS on a complete match;
    whether the next byte is forced: llguidance then allows only the canonical tokenization
    of the forced text, a subset of the valid tokens)."""
    allowed = {i for i, b in candidates.items() if b and BYTES_PATTERN.fullmatch(prefix + b, partial=True)}
    complete = BYTES_PATTERN.fullmatch(prefix) is not None
    next_bytes = [b for b in range(256) if BYTES_PATTERN.fullmatch(prefix + bytes([b]), partial=True)]
    return allowed | (eos if complete else set()), len(next_bytes) == 1 and not complete


def test_regex_mask_is_exact(vocab):
    """At every state of random walks, the mask is exactly the set of tokens that keep the
    bytes a prefix of the language, plus EOS where a match is complete; special tokens and the
    model's padding rows are never allowed."""
    tok, token_bytes = vocab
    n_vocab = tok.vocab_size + PADDING
    candidates = {i: b for i in range(tok.vocab_size) if (b := token_bytes(i)) is not None}
    eos = set(tok.eos_token_ids)
    byte_tokens = {i for i in candidates if tok.backend.id_to_token(i).startswith("<0x")}
    multi_symbol = used_bytes = free_states = 0
    walks = 3 if tok.vocab_size > 10_000 else 6
    for seed in range(walks):
        rng = random.Random(seed)
        constraint = make_constraint(tok, n_vocab, regex=PATTERN)
        prefix = b""
        for _ in range(60):
            mask = np.array(constraint.next_mask())
            assert mask.shape == (n_vocab,) and not mask[tok.vocab_size:].any()
            allowed = set(np.flatnonzero(mask).tolist())
            expected, forced = _expected(prefix, candidates, eos)
            if forced:
                assert allowed and allowed <= expected, prefix
            else:
                assert allowed == expected, prefix
                free_states += 1
            multi_symbol += sum(len(candidates.get(i, b"").decode("utf-8", "ignore")) > 1 for i in allowed)
            # Prefer byte-fallback tokens half of the time, so multi-byte characters get spelled bytewise.
            pool = sorted(allowed & byte_tokens) if byte_tokens and rng.random() < 0.5 else []
            choice = rng.choice(pool or sorted(allowed))
            constraint.advance(choice)
            if choice in eos:
                break
            prefix += candidates[choice]
            used_bytes += choice in byte_tokens
            if constraint.done:
                break
        assert constraint.done and BYTES_PATTERN.fullmatch(prefix), prefix
    assert free_states >= walks  # the exact comparison ran
    assert multi_symbol > 0  # tokens spanning several characters of the pattern were checked
    assert used_bytes > 0 or not byte_tokens  # byte-fallback kinds spelled characters bytewise


SCHEMA = {
    "type": "object",
    "properties": {
        "word": {"enum": ["the", "über", "日本 Ω", "😀"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,4}$"}, "maxItems": 2},
    },
    "required": ["word", "n"],
    "additionalProperties": False,
}


def test_json_walks_validate(vocab):
    """Random walks through the JSON-schema mask always end in a document jsonschema accepts."""
    tok, token_bytes = vocab
    eos = set(tok.eos_token_ids)
    for seed in range(4):
        rng = random.Random(seed)
        constraint = make_constraint(tok, tok.vocab_size, response_format=SCHEMA)
        out = b""
        for _ in range(400):
            allowed = np.flatnonzero(np.array(constraint.next_mask())).tolist()
            # Lean towards short tokens that are not whitespace so that walks finish.
            short = [i for i in allowed if i in eos or (b := token_bytes(i)) is not None and b.strip()]
            choice = rng.choice(short or allowed)
            constraint.advance(choice)
            if choice in eos:
                break
            out += token_bytes(choice)
            if constraint.done:
                break
        assert constraint.done, out
        jsonschema.validate(json.loads(out.decode("utf-8")), SCHEMA)


def test_bad_schema_and_grammar_are_one_line_errors(vocab):
    tok, _ = vocab
    bad = [
        dict(response_format={"type": "object", "properties": {"a": {"type": "no-such-type"}}}),
        dict(regex="(unclosed"),
        dict(grammar="start: missing_rule\n"),
        dict(grammar="root ::= \"a\" undefined-rule\n"),
        dict(response_format="not a dict"),
        dict(regex="a+", grammar="start: \"a\""),
    ]
    for kwargs in bad:
        with pytest.raises(MlxformerError) as info:
            make_constraint(tok, tok.vocab_size, **kwargs)
        assert "\n" not in str(info.value), kwargs
    assert make_constraint(tok, tok.vocab_size, response_format={"type": "text"}) is None
