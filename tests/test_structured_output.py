"""Structured output on the real SmolLM2 (greedy): JSON Schemas validated by ``jsonschema``, a regex
checked by Python's ``re``, a GBNF arithmetic grammar checked by a small parser; a conforming
greedy output is unchanged by the constraint; the CLI flags and their one-line errors."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from mlxformer.cli import main
from mlxformer.errors import MlxformerError
from mlxformer.generation import generate, stream_generate
from structured_cases import CASES, MAX_TOKENS, prompt_for

ARITHMETIC_GBNF = r"""
root   ::= expr
expr   ::= term (("+" | "-") term){0,3}
term   ::= factor (("*" | "/") factor){0,2}
factor ::= [0-9]{1,3} | "(" expr ")"
"""


def _run(model, tokenizer, prompt: str, max_tokens: int = MAX_TOKENS, **constraint) -> tuple[str, str]:
    """(text, finish_reason) of a greedy chat completion."""
    ids = tokenizer.encode_prompt(prompt)
    responses = list(stream_generate(model, tokenizer, ids, max_tokens, **constraint))
    return "".join(r.text for r in responses), responses[-1].finish_reason


def _free_json(model, tokenizer, prompt: str, schema: dict) -> tuple[str, bool]:
    """The unconstrained greedy output and whether it validates. Generation stops as soon as the
    text can no longer be a lone JSON document (it does not start with ``{``, or a complete
    document is followed by more text): json.loads of the whole output would fail whatever follows."""
    text = ""
    for response in stream_generate(model, tokenizer, tokenizer.encode_prompt(prompt), MAX_TOKENS):
        text += response.text
        body = text.lstrip()
        if body and not body.startswith("{"):
            return text, False
        try:
            _, end = json.JSONDecoder().raw_decode(body)
        except json.JSONDecodeError:
            continue
        if body[end:].strip():
            return text, False
    try:
        jsonschema.validate(json.loads(text), schema)
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return text, False
    return text, True


def test_json_schemas_hold_and_conforming_output_is_unchanged(smollm):
    """Every constrained output parses and validates; where the free output already validates,
    the constrained output is identical to it."""
    model, tokenizer = smollm
    free_failures, unchanged = [], 0
    for description, schema in CASES:
        prompt = prompt_for(description)
        text, finish = _run(model, tokenizer, prompt, response_format=schema)
        assert finish == "stop", (description, text)
        jsonschema.validate(json.loads(text), schema)
        free_text, free_valid = _free_json(model, tokenizer, prompt, schema)
        if free_valid:
            assert text == free_text, description
            unchanged += 1
        else:
            free_failures.append(description)
    print(f"\nwithout the constraint {len(free_failures)} of {len(CASES)} outputs fail to validate; "
          f"with it 0 of {len(CASES)}; {unchanged} already-valid outputs unchanged")
    assert unchanged >= 1  # the identity check ran


def test_regex_holds_and_conforming_output_is_unchanged(smollm):
    model, tokenizer = smollm
    pattern = r"[0-9]{3}-[0-9]{3}-[0-9]{4}"
    text, finish = _run(model, tokenizer, "Make up a phone number.", 24, regex=pattern)
    assert finish == "stop" and re.fullmatch(pattern, text), text
    prompt, sentence = "What is the capital of France? Answer with one word.", r"[A-Z][A-Za-z ]*\."
    free, _ = _run(model, tokenizer, prompt, 12)
    assert re.fullmatch(sentence, free), free  # the free answer conforms...
    assert _run(model, tokenizer, prompt, 12, regex=sentence) == (free, "stop")  # ...and is unchanged


def _parse_arithmetic(text: str) -> int:
    """Recursive-descent parser of the grammar's language; returns how many numbers it read."""
    pos = 0

    def number() -> int:
        nonlocal pos
        match = re.match(r"[0-9]{1,3}", text[pos:])
        assert match, (text, pos)
        pos += match.end()
        return 1

    def factor() -> int:
        nonlocal pos
        if text[pos:pos + 1] == "(":
            pos += 1
            count = expr()
            assert text[pos:pos + 1] == ")", (text, pos)
            pos += 1
            return count
        return number()

    def chain(item, ops: str, most: int) -> int:
        nonlocal pos
        count = item()
        for _ in range(most):
            if text[pos:pos + 1] and text[pos] in ops:
                pos += 1
                count += item()
        return count

    def term() -> int:
        return chain(factor, "*/", 2)

    def expr() -> int:
        return chain(term, "+-", 3)

    count = expr()
    assert pos == len(text), (text, pos)
    return count


def test_gbnf_arithmetic_holds(smollm):
    model, tokenizer = smollm
    text, finish = _run(model, tokenizer, "Write an arithmetic expression equal to 12.", 32, grammar=ARITHMETIC_GBNF)
    assert finish == "stop"
    assert _parse_arithmetic(text) >= 1, text
    with pytest.raises(AssertionError):
        _parse_arithmetic("1+(2*3")  # the checker itself rejects malformed text


def test_length_cut_is_reported(smollm):
    model, tokenizer = smollm
    schema = {"type": "object", "properties": {"story": {"type": "string"}}, "required": ["story"]}
    text, finish = _run(model, tokenizer, "Tell a long story as JSON.", 6, response_format=schema)
    assert finish == "length" and text.startswith("{")
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)


def test_library_errors_before_generation(smollm):
    model, tokenizer = smollm
    with pytest.raises(MlxformerError, match="JSON schema"):
        generate(model, tokenizer, "hi", 4, response_format={"type": "object", "properties": {"a": {"type": 5}}})
    with pytest.raises(MlxformerError, match="at most one"):
        generate(model, tokenizer, "hi", 4, regex="a", grammar='start: "a"')


def _cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["generate", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_flags(capsys, smollm_gguf, tmp_path):
    lark = tmp_path / "answer.lark"
    lark.write_text('start: "yes" | "no"\n')
    gbnf = tmp_path / "digits.gbnf"
    gbnf.write_text('root ::= [0-9] [0-9]?\n')
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                                  "additionalProperties": False}))
    model = ["--model", str(smollm_gguf), "--max-tokens", "12"]
    code, out, _ = _cli(capsys, *model, "--prompt", "Is the sky blue?", "--grammar", str(lark))
    assert code == 0 and out.strip() in ("yes", "no"), out
    code, out, _ = _cli(capsys, *model, "--prompt", "How many legs has a dog?", "--grammar", str(gbnf))
    assert code == 0 and re.fullmatch(r"[0-9]{1,2}", out.strip()), out
    code, out, _ = _cli(capsys, *model, "--prompt", "Is fire hot? JSON please.", "--json-schema", str(schema))
    assert code == 0 and isinstance(json.loads(out)["ok"], bool), out
    code, out, _ = _cli(capsys, *model, "--prompt", "Say 3 digits.", "--regex", "[0-9]{3}")
    assert code == 0 and re.fullmatch("[0-9]{3}", out.strip()), out


@pytest.mark.parametrize("flags, needle", [
    (["--json-schema", '{"type": "object", "properties": {"a": {"type": "nope"}}}'], "JSON schema"),
    (["--json-schema", "{not json"], "not valid JSON"),
    (["--regex", "(ab"], "regex"),
    (["--grammar", "MISSING.lark"], "cannot read"),
])
def test_cli_bad_constraint_is_one_line_error_before_loading(capsys, tmp_path, flags, needle):
    """The error comes before the model loads: the model path given does not even exist."""
    flags = [str(tmp_path / f) if f.endswith(".lark") else f for f in flags]
    code, out, err = _cli(capsys, "--model", str(tmp_path / "no-model"), "--prompt", "hi", *flags)
    lines = err.strip().splitlines()
    assert code == 1 and out == "" and len(lines) == 1 and lines[0].startswith("mlxformer: error: "), err
    assert needle in lines[0] and "no-model" not in lines[0], lines[0]
