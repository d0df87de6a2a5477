"""``mlxformer generate``: stream a completion to stdout, statistics to stderr."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any

from mlxformer.cli.common import (
    add_cache_args, add_model_args, add_prompt_args, add_sampling_args, add_verbose, cache_settings, load_for_cli,
    prompt_ids_for_cli, read_prompt, sampling_settings,
)

if TYPE_CHECKING:
    from pathlib import Path

    from mlxformer.generation import GenerationResponse


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``generate`` subcommand."""
    parser = subparsers.add_parser("generate", help="generate text from a prompt")
    add_model_args(parser)
    add_prompt_args(parser)
    add_sampling_args(parser)
    add_cache_args(parser)
    parser.add_argument("--prompt-cache-file", help="continue from a cache saved by 'mlxformer cache-prompt'")
    structured = parser.add_mutually_exclusive_group()
    structured.add_argument("--json-schema", metavar="FILE_OR_JSON",
                            help="constrain the output to JSON valid under this schema (a file, or inline JSON)")
    structured.add_argument("--regex", metavar="PATTERN", help="constrain the output to match this regular expression")
    structured.add_argument("--grammar", metavar="FILE",
                            help="constrain the output to this grammar: Lark (.lark) or llama.cpp GBNF (.gbnf)")
    add_verbose(parser)
    parser.set_defaults(handler=run)


def format_stats(response: GenerationResponse) -> str:
    """One stats line for stderr."""
    return (
        f"prompt: {response.prompt_tokens} tokens, {response.prompt_tps:.1f} tok/s | "
        f"generation: {response.generation_tokens} tokens, {response.generation_tps:.1f} tok/s | "
        f"peak memory: {response.peak_memory_gb:.3f} GB"
    )


def run(args: argparse.Namespace) -> int:
    """Handler of ``mlxformer generate``."""
    from mlxformer.constrained import make_constraint, validate_structured_output
    from mlxformer.generation import stream_generate

    prompt = read_prompt(args.prompt)
    sampling = sampling_settings(args)
    settings = cache_settings(args)
    structured = structured_output_args(args)
    validate_structured_output(**structured)  # a bad schema or grammar fails before the model loads
    model, tokenizer = load_for_cli(args)
    constraint = make_constraint(tokenizer, model.args.vocab_size, **structured) if structured else None
    ids = prompt_ids_for_cli(tokenizer, prompt, args)
    cache = None
    if args.prompt_cache_file:
        from mlxformer.cache.files import load_prompt_cache, strip_cached_prefix

        cache, cached_ids = load_prompt_cache(args.prompt_cache_file, model)
        ids = strip_cached_prefix(ids, cached_ids)
    last = None
    for last in stream_generate(
        model, tokenizer, ids, args.max_tokens, sampling=sampling, stop=args.stop, cache=cache,
        cache_settings=settings, constraint=constraint,
    ):
        sys.stdout.write(last.text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    if last is not None:
        print(format_stats(last), file=sys.stderr)
        if constraint is not None and last.finish_reason == "length":
            print("mlxformer: warning: --max-tokens cut the structured output short: it is incomplete", file=sys.stderr)
    return 0


def structured_output_args(args: argparse.Namespace) -> dict[str, Any]:
    """``response_format``/``regex``/``grammar`` keywords from ``--json-schema``, ``--regex``, ``--grammar``."""
    import json
    from pathlib import Path

    from mlxformer.constrained import lark_from_gbnf
    from mlxformer.errors import MlxformerError

    if args.regex is not None:
        return {"regex": args.regex}
    if args.json_schema is not None:
        text = args.json_schema
        if not text.lstrip().startswith("{"):
            text = _read_text(Path(text), "--json-schema")
        try:
            schema = json.loads(text)
        except json.JSONDecodeError as exc:
            raise MlxformerError(f"--json-schema is not valid JSON: {exc}") from exc
        if not isinstance(schema, dict):
            raise MlxformerError("--json-schema must be a JSON object")
        return {"response_format": schema}
    if args.grammar is not None:
        path = Path(args.grammar)
        text = _read_text(path, "--grammar")
        return {"grammar": lark_from_gbnf(text) if path.suffix.lower() == ".gbnf" else text}
    return {}


def _read_text(path: Path, flag: str) -> str:
    from mlxformer.errors import MlxformerError

    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise MlxformerError(f"{flag}: cannot read {path}: {exc.strerror if isinstance(exc, OSError) else exc}") from exc
