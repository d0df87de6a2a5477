"""``mlxformer generate``: stream a completion to stdout, statistics to stderr."""

from __future__ import annotations

import argparse
import sys

from .cli import add_cache_args, add_model_args, add_sampling_args, cache_settings, load_for_cli, sampling_settings
from .errors import MlxformerError
from .generate import GenerationResponse, stream_generate
from .tokenizer import Tokenizer


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``generate`` subcommand."""
    parser = subparsers.add_parser("generate", help="generate text from a prompt")
    add_model_args(parser)
    add_prompt_args(parser)
    add_sampling_args(parser)
    add_cache_args(parser)
    parser.add_argument("--prompt-cache-file", help="continue from a cache saved by 'mlxformer cache-prompt'")
    parser.add_argument("--verbose", "-v", action="store_true", dest="verbose_sub", help="show tracebacks")
    parser.set_defaults(handler=run)


def add_prompt_args(parser: argparse.ArgumentParser) -> None:
    """``--prompt``, ``--system`` and ``--ignore-chat-template``."""
    parser.add_argument("--prompt", "-p", required=True, help="the prompt; '-' reads it from stdin")
    parser.add_argument("--system", help="system message (with a chat template)")
    parser.add_argument("--ignore-chat-template", action="store_true", help="use the prompt raw, without the chat template")


def read_prompt(value: str) -> str:
    """The prompt text; ``-`` reads stdin. An empty prompt is an error."""
    text = sys.stdin.read() if value == "-" else value
    if not text.strip():
        raise MlxformerError("empty prompt")
    return text


def prompt_ids(
    tokenizer: Tokenizer, prompt: str, system: str | None, use_template: bool, add_generation_prompt: bool = True
) -> list[int]:
    """Token ids for a user prompt, through the chat template when there is one and it is wanted."""
    if use_template and tokenizer.chat_template:
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        return tokenizer.encode(text, add_special_tokens=False)
    if system:
        print("mlxformer: note: --system is ignored without a chat template", file=sys.stderr)
    return tokenizer.encode(prompt)


def format_stats(response: GenerationResponse) -> str:
    """One stats line for stderr."""
    return (
        f"prompt: {response.prompt_tokens} tokens, {response.prompt_tps:.1f} tok/s | "
        f"generation: {response.generation_tokens} tokens, {response.generation_tps:.1f} tok/s | "
        f"peak memory: {response.peak_memory_gb:.3f} GB"
    )


def run(args: argparse.Namespace) -> int:
    prompt = read_prompt(args.prompt)
    sampling = sampling_settings(args)
    settings = cache_settings(args)
    model, tokenizer = load_for_cli(args)
    ids = prompt_ids(tokenizer, prompt, args.system, not args.ignore_chat_template)
    cache = None
    if args.prompt_cache_file:
        from .prompt_cache import load_prompt_cache, strip_cached_prefix

        cache, cached_ids = load_prompt_cache(args.prompt_cache_file, model)
        ids = strip_cached_prefix(ids, cached_ids)
    last = None
    for last in stream_generate(
        model, tokenizer, ids, args.max_tokens, sampling=sampling, stop=args.stop, cache=cache, cache_settings=settings
    ):
        sys.stdout.write(last.text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    if last is not None:
        print(format_stats(last), file=sys.stderr)
    return 0
