"""``mlxformer generate``: stream a completion to stdout, statistics to stderr."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from mlxformer.cli.common import (
    add_cache_args, add_model_args, add_prompt_args, add_sampling_args, add_speculative_args, add_verbose,
    cache_settings, flag_error, load_for_cli, prompt_ids_for_cli, read_prompt, sampling_settings, speculates,
    speculative_settings, verbose,
)
from mlxformer.cli.structured import add_structured_args, structured_output_args

if TYPE_CHECKING:
    from mlxformer.generation.stream import GenerationResponse


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``generate`` subcommand."""
    parser = subparsers.add_parser("generate", help="generate text from a prompt")
    add_model_args(parser)
    add_prompt_args(parser)
    add_sampling_args(parser)
    add_cache_args(parser)
    parser.add_argument("--prompt-cache-file", help="continue from a cache saved by 'mlxformer cache-prompt'")
    add_speculative_args(parser)
    parser.add_argument(
        "--parallel", choices=("pipeline", "tensor"),
        help="spread the model over the ranks started by mlx.launch: layers (pipeline) or heads and MLP columns (tensor)",
    )
    parser.add_argument(
        "--timeout", type=float, default=60.0,
        help="with --parallel: longest wait for another rank, in seconds, before giving up (default 60)",
    )
    add_structured_args(parser)
    add_verbose(parser)
    parser.set_defaults(handler=run)


def format_stats(response: GenerationResponse, speculative: bool = False) -> str:
    """One stats line for stderr (with the speculative acceptance when ``speculative``)."""
    line = (
        f"prompt: {response.prompt_tokens} tokens, {response.prompt_tps:.1f} tok/s | "
        f"generation: {response.generation_tokens} tokens, {response.generation_tps:.1f} tok/s | "
        f"peak memory: {response.peak_memory_gb:.3f} GB"
    )
    if speculative:
        proposed, accepted = response.proposed_tokens, response.accepted_tokens
        share = accepted / proposed if proposed else 0.0
        line += f" | speculative: accepted {accepted}/{proposed} proposed tokens ({share:.0%})"
    return line


def run(args: argparse.Namespace) -> int:
    """Handler of ``mlxformer generate``."""
    if args.parallel:
        return run_parallel(args)
    from mlxformer.constrained import make_constraint, validate_structured_output
    from mlxformer.errors import MlxformerError, OptionError
    from mlxformer.generation.stream import stream_generate

    prompt = read_prompt(args.prompt)
    sampling_settings(args)  # bad flags fail before the model loads
    settings = cache_settings(args)
    structured = structured_output_args(args)
    if structured and speculates(args):
        raise MlxformerError("--json-schema, --regex and --grammar are not supported with speculative decoding")
    validate_structured_output(**structured)  # a bad schema or grammar fails before the model loads
    model, tokenizer = load_for_cli(args)
    sampling = sampling_settings(args, tokenizer.sampling_defaults)
    speculative = speculative_settings(args, tokenizer, model)
    constraint = make_constraint(tokenizer, model.args.vocab_size, **structured) if structured else None
    ids = prompt_ids_for_cli(tokenizer, prompt, args)
    cache = None
    if args.prompt_cache_file:
        from mlxformer.generation.prompt_cache_files import load_prompt_cache, strip_cached_prefix

        cache, cached_ids = load_prompt_cache(args.prompt_cache_file, model, tokenizer, settings)
        strip_cached_prefix(ids, cached_ids)  # the prompt must continue the cached tokens
    last = None
    try:
        for last in stream_generate(
            model, tokenizer, ids, args.max_tokens, sampling=sampling, stop=args.stop, cache=cache,
            cache_settings=settings, speculative=speculative, constraint=constraint,
        ):
            sys.stdout.write(last.text)
            sys.stdout.flush()
    except OptionError as exc:  # e.g. a --logit-bias id outside the vocabulary
        raise flag_error(exc) from None
    sys.stdout.write("\n")
    if last is not None:
        print(format_stats(last, speculative is not None and verbose(args)), file=sys.stderr)
        if last.incomplete:
            cause = "--max-tokens" if last.finish_reason == "length" else "a --stop string"
            print(f"mlxformer: warning: {cause} cut the structured output short: it is incomplete", file=sys.stderr)
    return 0


def run_parallel(args: argparse.Namespace) -> int:
    """``generate --parallel``: every rank runs this; rank 0 alone prints."""
    from mlxformer.default_model import model_source
    from mlxformer.distributed.runner import load_distributed, stream_distributed
    from mlxformer.errors import MlxformerError, OptionError
    from mlxformer.sampling.model_defaults import NO_DEFAULTS
    from mlxformer.models.config import FLOAT_DTYPES

    if args.prompt_cache_file or args.adapter:
        raise MlxformerError("--prompt-cache-file and --adapter are not supported with --parallel")
    if structured_output_args(args):
        raise MlxformerError("--json-schema, --regex and --grammar are not supported with --parallel")
    if speculates(args):
        raise MlxformerError("speculative decoding is not supported with --parallel")
    if args.threads not in (None, 1):
        raise MlxformerError("--threads is not supported with --parallel (each rank runs one stream)")
    if args.prompt == "-":  # mlx.launch forwards stdin to every rank but never closes it: reading would hang
        raise MlxformerError("--prompt - is not supported with --parallel; pass the text, e.g. --prompt \"$(cat FILE)\"")
    prompt = read_prompt(args.prompt)
    sampling = sampling_settings(args, NO_DEFAULTS)  # every rank samples alike: flags and the built-in defaults
    settings = cache_settings(args)
    dtype = FLOAT_DTYPES[args.dtype] if args.dtype else None
    try:
        dist = load_distributed(model_source(args.model), args.parallel, dtype, args.timeout)
    except OptionError as exc:
        raise flag_error(exc) from None
    ids = prompt_ids_for_cli(dist.tokenizer, prompt, args) if dist.tokenizer is not None else []
    last = None
    for last in stream_distributed(dist, ids, args.max_tokens, sampling=sampling, stop=args.stop, cache_settings=settings):
        sys.stdout.write(last.text)
        sys.stdout.flush()
    if dist.leader:
        sys.stdout.write("\n")
        if last is not None:
            print(format_stats(last), file=sys.stderr)
    return 0
