"""``mlxformer serve``: an OpenAI-compatible HTTP server with a chat page, on the batching engine."""

from __future__ import annotations

import argparse
import os

from mlxformer.cli.common import (
    add_cache_args, add_model_args, add_speculative_args, add_verbose, cache_settings, load_for_cli, speculative_settings,
)

API_KEY_VARIABLE = "MLXFORMER_API_KEY"


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``serve`` subcommand."""
    parser = subparsers.add_parser("serve", help="serve an OpenAI-compatible API and a chat page")
    add_model_args(parser)
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=8080, help="port (default 8080)")
    parser.add_argument("--max-batch", type=int, default=8, help="most sequences decoded together (default 8)")
    parser.add_argument("--max-queue", type=int, default=64, help="most requests waiting; beyond, 429 (default 64)")
    parser.add_argument(
        "--max-kv-memory", metavar="BYTES|auto", default=None,
        help="KV cache memory budget of all requests and the prompt cache's memory tier (e.g. 4GiB, 500M; auto: the "
             "device's memory less the weights and a margin); a request that can never fit gets 400 (default: none)",
    )
    parser.add_argument(
        "--api-key", default=os.environ.get(API_KEY_VARIABLE) or None,
        help=f"require 'Authorization: Bearer KEY' or 'x-api-key: KEY' on /v1 (default: ${API_KEY_VARIABLE}, else none)",
    )
    parser.add_argument(
        "--cors-origin", action="extend", nargs="+", default=[], metavar="ORIGIN",
        help="allow cross-origin requests from ORIGIN (repeatable; default: none)",
    )
    parser.add_argument(
        "--allowed-host", action="extend", nargs="+", default=[], metavar="NAME",
        help="also answer requests whose Host header is NAME (repeatable; on a loopback --host only that "
             "address and localhost are answered, against DNS rebinding)",
    )
    parser.add_argument("--max-body-bytes", type=int, help="largest request body; beyond, 413 (default 4 MiB)")
    parser.add_argument("--no-openapi", action="store_true", help="do not serve /openapi.json")
    parser.add_argument("--served-model-name",
                        help="the model name clients use (default: the model's file or folder name)")
    parser.add_argument("--tool-parser", metavar="NAME",
                        help="the tool-call format (hermes, qwen3_coder, llama3_json, mistral, mistral_v11, json; "
                             "default: the one the chat template teaches)")
    parser.add_argument("--strict-model-name", action="store_true",
                        help="the Anthropic and Responses routes answer only the served model name (default: any "
                             "name, e.g. Claude Code's claude-*, is served by the loaded model)")
    parser.add_argument("--strict-max-tokens", action="store_true",
                        help="the Messages API refuses a max_tokens beyond what the context has left, in Anthropic's "
                             "wording (default: clamped to it, reported in usage and x-mlxformer-max-tokens)")
    parser.add_argument("--force-tool", action="append", default=[], metavar="NAME",
                        help="reply to a user turn that offers tool NAME (and leaves the choice to the model) with a "
                             "call of it; repeatable, the first offered wins (trying an agent's tool loop with a "
                             "model that cannot choose tools)")
    parser.add_argument("--prompt-cache-bytes", type=int, default=512 * 2**20, metavar="BYTES",
                        help="prompt cache kept in memory, least recently used out (default 512 MiB; 0: none)")
    parser.add_argument("--prompt-cache-dir", metavar="DIR",
                        help="also keep prompt cache blocks in DIR, across restarts (default: memory only)")
    parser.add_argument("--prompt-cache-disk-bytes", type=int, default=4 * 2**30, metavar="BYTES",
                        help="most bytes of prompt cache files in --prompt-cache-dir (default 4 GiB)")
    parser.add_argument("--sse-ping-seconds", type=float, default=5.0, metavar="S",
                        help="send an SSE comment after S seconds without data, e.g. during a long prefill "
                             "(default 5; 0: never)")
    parser.add_argument("--no-prefix-sharing", action="store_true",
                        help="let requests that share a prefix with one being prefilled compute it again "
                             "(default: they wait for its cached blocks)")
    add_cache_args(parser)
    add_speculative_args(parser)
    add_verbose(parser)
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """Handler of ``mlxformer serve``."""
    from mlxformer.engine.memory import parse_kv_memory
    from mlxformer.engine.prompt_cache import PromptCacheSettings
    from mlxformer.errors import MlxformerError
    from mlxformer.server.heap import bound_heap_growth
    from mlxformer.server.runner import serve

    if not 0 <= args.port <= 65535:
        raise MlxformerError("--port must be between 0 and 65535")
    if args.max_batch < 1 or args.max_queue < 0:
        raise MlxformerError("need --max-batch >= 1 and --max-queue >= 0")
    if not args.sse_ping_seconds >= 0:
        raise MlxformerError("--sse-ping-seconds must be >= 0")
    if args.api_key is not None and not args.api_key.strip():
        raise MlxformerError("--api-key is empty")
    if args.max_body_bytes is not None and args.max_body_bytes < 1:
        raise MlxformerError("--max-body-bytes must be >= 1")
    if args.tool_parser is not None:
        from mlxformer.server.toolcalls import call_format

        call_format(args.tool_parser)  # an unknown name fails before the model loads
    settings = cache_settings(args)
    max_kv_memory = parse_kv_memory(args.max_kv_memory) if args.max_kv_memory is not None else None
    prompt_cache = PromptCacheSettings(args.prompt_cache_bytes, args.prompt_cache_dir, args.prompt_cache_disk_bytes,
                                       share_prefills=not args.no_prefix_sharing)
    bound_heap_growth()  # a long-running process: RSS must not creep (Linux glibc; server/heap.py)
    model, tokenizer = load_for_cli(args)
    speculative = speculative_settings(args, tokenizer)
    name = args.served_model_name or (model_name(args.model) if args.model else default_model_name())
    serve(
        model, tokenizer, name, host=args.host, port=args.port, max_batch=args.max_batch, max_queue=args.max_queue,
        api_key=args.api_key, cors_origins=args.cors_origin, cache_settings=settings, speculative=speculative,
        allowed_hosts=args.allowed_host, openapi=not args.no_openapi, prompt_cache=prompt_cache,
        tool_parser=args.tool_parser, any_model_name=not args.strict_model_name,
        sse_ping_seconds=args.sse_ping_seconds or None, max_kv_memory=max_kv_memory,
        strict_max_tokens=args.strict_max_tokens, force_tools=args.force_tool,
        **({"max_body_bytes": args.max_body_bytes} if args.max_body_bytes is not None else {}),
    )
    return 0


def model_name(model: str) -> str:
    """The served name of ``--model``: a local file's name without the extension, a local
    folder's name (never a path: /health shows it), a hub id as given."""
    from pathlib import Path

    path = Path(model).expanduser()
    if path.is_file():
        return path.stem
    if path.is_dir():
        return path.resolve().name
    return model


def default_model_name() -> str:
    """The served name of the default model: its file name without the extension."""
    from mlxformer.default_model import default_model_path

    return default_model_path().stem
