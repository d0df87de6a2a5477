"""How many of the 20 JSON-Schema prompts of the tests validate with and without the constraint
(SmolLM2, greedy). Without it, a free answer counts as valid only if the whole output parses as
one JSON document that ``jsonschema`` accepts (a fenced or commented answer does not).

Usage: python benchmarks/structured_validity.py [--model PATH]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

CASES_FILE = Path(__file__).resolve().parents[1] / "tests" / "data" / "structured_cases.json"


def validates(text: str, schema: dict) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), schema)
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the offline SmolLM2-135M-Instruct GGUF")
    args = parser.parse_args()

    from mlxformer.default_model import default_model_path
    from mlxformer.generation.stream import stream_generate
    from mlxformer.loader import load

    data = json.loads(CASES_FILE.read_text(encoding="utf-8"))
    model, tokenizer = load(args.model or default_model_path())
    valid = {"free": 0, "constrained": 0}
    for case in data["cases"]:
        ids = tokenizer.encode_prompt(data["prompt_prefix"] + case["description"])
        row = []
        for mode in ("free", "constrained"):
            extra = {"response_format": case["schema"]} if mode == "constrained" else {}
            responses = list(stream_generate(model, tokenizer, ids, data["max_tokens"], **extra))
            text = "".join(r.text for r in responses)
            ok = validates(text, case["schema"])
            valid[mode] += ok
            row.append(f"{mode} {'valid' if ok else 'INVALID'} ({responses[-1].finish_reason}, {len(responses)} tok)")
        print(f"{case['description'][:50]:50} | " + " | ".join(row), flush=True)
    n = len(data["cases"])
    print(f"\nvalid without the constraint: {valid['free']}/{n}; with it: {valid['constrained']}/{n}")


if __name__ == "__main__":
    main()
