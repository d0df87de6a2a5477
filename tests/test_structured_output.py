"""Structured output on the real SmolLM2 (greedy): JSON Schemas validated by ``jsonschema``, a regex
checked by Python's ``re``, a GBNF arithmetic grammar checked by a small parser; a conforming
greedy output is unchanged by the constraint; the CLI flags and their one-line errors."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest

from mlxformer.cli import main
from mlxformer.errors import MlxformerError
from mlxformer.generation.stream import generate, stream_generate

CASES_FILE = Path(__file__).parent / "data" / "structured_cases.json"  # shared with benchmarks/structured_validity.py
_DATA = json.loads(CASES_FILE.read_text(encoding="utf-8"))
CASES = [(c["description"], c["schema"]) for c in _DATA["cases"]]
MAX_TOKENS = _DATA["max_tokens"]

ARITHMETIC_GBNF = r"""
root   ::= expr
expr   ::= term (("+" | "-") term){0,3}
term   ::= factor (("*" | "/") factor){0,2}
factor ::= [0-9]{1,3} | "(" expr ")"
"""


def prompt_for(description: str) -> str:
    return _DATA["prompt_prefix"] + description


_RUNS: dict[tuple, tuple[str, str]] = {}


def _run(model, tokenizer, prompt: str, max_tokens: int = MAX_TOKENS, **constraint) -> tuple[str, str]:
    """(text, finish_reason) of a greedy chat completion; greedy decoding is deterministic, so
    a run two tests need (the first case, constrained) is decoded once per module."""
    key = (id(model), prompt, max_tokens, json.dumps(constraint, sort_keys=True))
    if key not in _RUNS:
        ids = tokenizer.encode_prompt(prompt)
        responses = list(stream_generate(model, tokenizer, ids, max_tokens, **constraint))
        _RUNS[key] = "".join(r.text for r in responses), responses[-1].finish_reason
    return _RUNS[key]


SUITE_CASES = [CASES[i] for i in (0, 7, 13, 18)]  # an object, a pattern, an enum, an array of objects (~18 s each here)


def test_json_schemas_hold(smollm):
    """Every constrained output of a spread of the 20 cases parses and validates. (All 20, and
    how many fail without the constraint: ``benchmarks/structured_validity.py``, which checks
    every case's constrained output the same way; 19 of 20 free outputs fail when measured.)"""
    model, tokenizer = smollm
    for description, schema in SUITE_CASES:
        text, finish = _run(model, tokenizer, prompt_for(description), response_format=schema)
        assert finish == "stop", (description, text)
        jsonschema.validate(json.loads(text), schema)


def test_conforming_json_is_unchanged(smollm):
    """The first case's free greedy answer already validates: the constraint leaves it as it is."""
    model, tokenizer = smollm
    description, schema = CASES[0]
    free, finish = _run(model, tokenizer, prompt_for(description))
    assert finish == "stop"
    jsonschema.validate(json.loads(free), schema)  # conforms without the constraint...
    assert _run(model, tokenizer, prompt_for(description), response_format=schema) == (free, "stop")  # ...unchanged


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
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                                  "additionalProperties": False}))
    model = ["--model", str(smollm_gguf), "--max-tokens", "12"]
    code, out, _ = _cli(capsys, *model, "--prompt", "Is the sky blue?", "--grammar", str(lark))
    assert code == 0 and out.strip() in ("yes", "no"), out
    code, out, _ = _cli(capsys, *model, "--prompt", "Is fire hot? JSON please.", "--json-schema", str(schema))
    assert code == 0 and isinstance(json.loads(out)["ok"], bool), out


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


def test_cli_grammar_files(tmp_path):
    """``.gbnf`` files are converted to Lark; other extensions are told apart by their rules."""
    from argparse import Namespace

    from mlxformer.cli.structured import structured_output_args
    from mlxformer.constrained import validate_structured_output

    for name, text in [("a.gbnf", ARITHMETIC_GBNF), ("a.txt", ARITHMETIC_GBNF), ("a.lark", 'start: "yes" | "no"\n')]:
        (tmp_path / name).write_text(text)
        kwargs = structured_output_args(Namespace(regex=None, json_schema=None, grammar=str(tmp_path / name)))
        validate_structured_output(**kwargs)
        assert ("%llguidance" in kwargs["grammar"]) == (name == "a.gbnf"), name
