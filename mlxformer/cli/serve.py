"""``mlxformer serve``: an OpenAI-compatible HTTP server with a chat page, on the batching engine."""

from __future__ import annotations

import argparse
import os
from typing import Any, Callable

from mlxformer.cli.embed import add_pooling_arg, apply_pooling
from mlxformer.cli.common import (
    add_cache_args, add_model_args, add_speculative_args, add_verbose, cache_settings, load_for_cli, lora_flags, speculates,
    speculative_settings,
)

API_KEY_VARIABLE = "MLXFORMER_API_KEY"


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``serve`` subcommand."""
    parser = subparsers.add_parser("serve", help="serve an OpenAI-compatible API and a chat page")
    add_model_args(parser, several=True)
    add_pooling_arg(parser)
    parser.add_argument("--models-dir", metavar="DIR",
                        help="also serve every model in DIR (.gguf files and model folders), each loaded on first use")
    parser.add_argument("--models-from-cache", action="store_true",
                        help="also serve every loadable model of the Hugging Face cache (see 'mlxformer list')")
    parser.add_argument("--max-loaded-models", type=int, default=1, metavar="N",
                        help="with several models: most loaded at once, least recently used out (default 1)")
    parser.add_argument("--max-loaded-memory", metavar="BYTES|auto", default=None,
                        help="with several models: most bytes of loaded models, each counted as its weights plus its "
                             "KV budget (--max-kv-memory), least recently used out (auto: the device's memory less "
                             "a margin; default: no bound)")
    parser.add_argument("--idle-unload", type=float, default=None, metavar="SECONDS",
                        help="with several models: unload a model idle this long (default: never; a request's "
                             "keep_alive overrides it, Ollama's semantics)")
    parser.add_argument("--strict-model-names", action="store_true",
                        help="answer only the served model names, on every API: other names get 404 (default with "
                             "one model: any name is served by it, e.g. Claude Code's claude-*)")
    parser.add_argument("--strict-model-name", action="store_true", dest="strict_model_names",
                        help=argparse.SUPPRESS)  # the old spelling
    parser.add_argument("--lora", action="append", default=[], metavar="NAME=DIR",
                        help="load this adapter for requests to choose (lora: [{id, scale}], or model BASE:NAME); "
                             "requests on different adapters decode together (repeatable)")
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
    from mlxformer.default_model import model_source
    from mlxformer.engine.memory import parse_kv_memory
    from mlxformer.engine.prompt_cache import PromptCacheSettings
    from mlxformer.errors import MlxformerError
    from mlxformer.server.heap import bound_heap_growth
    from mlxformer.server.runner import bind, serve

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
    if lora_flags(args.lora) and args.adapter:  # before the model loads
        raise MlxformerError("--adapter applies one adapter to every request; with --lora, requests choose theirs")
    if args.tool_parser is not None:
        from mlxformer.server.toolcalls import call_format

        call_format(args.tool_parser)  # an unknown name fails before the model loads
    settings = cache_settings(args)
    max_kv_memory = parse_kv_memory(args.max_kv_memory) if args.max_kv_memory is not None else None
    prompt_cache = PromptCacheSettings(args.prompt_cache_bytes, args.prompt_cache_dir, args.prompt_cache_disk_bytes,
                                       share_prefills=not args.no_prefix_sharing)
    bound_heap_growth()  # a long-running process: RSS must not creep (Linux glibc; server/heap.py)
    sources = model_sources(args)
    sock = bind(args.host, args.port)  # a port in use fails now, not after the model loads
    if len(sources) > 1 or args.models_dir or args.models_from_cache:
        if args.lora or args.adapter:
            raise MlxformerError("--lora and --adapter serve one model")
        return run_several(args, sources, settings, max_kv_memory, prompt_cache, sock)
    args.model = next(iter(sources.values()), None)
    model, tokenizer = load_for_cli(args)
    apply_pooling(model, args.pooling)
    speculative = speculative_settings(args, tokenizer, model)
    name = args.served_model_name or (model_name(args.model) if args.model else default_model_name())
    serve(
        model, tokenizer, name, host=args.host, port=args.port, max_batch=args.max_batch, max_queue=args.max_queue,
        api_key=args.api_key, cors_origins=args.cors_origin, cache_settings=settings, speculative=speculative,
        allowed_hosts=args.allowed_host, openapi=not args.no_openapi, prompt_cache=prompt_cache,
        tool_parser=args.tool_parser, any_model_name=not args.strict_model_names,
        sse_ping_seconds=args.sse_ping_seconds or None, max_kv_memory=max_kv_memory,
        source=str(model_source(args.model)),
        strict_max_tokens=args.strict_max_tokens, force_tools=args.force_tool, sock=sock,
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


def model_sources(args: argparse.Namespace) -> dict[str, str]:
    """``{served name: source}`` of ``--model`` (each), ``--models-dir`` and ``--models-from-cache``."""
    from pathlib import Path

    from mlxformer.errors import MlxformerError

    sources: dict[str, str] = {}
    models = args.model or []
    for model in models:
        sources[args.served_model_name if args.served_model_name and len(models) == 1 else model_name(model)] = model
    if args.models_dir:
        from mlxformer.formats.gguf_split import split_part_names

        folder = Path(args.models_dir).expanduser()
        if not folder.is_dir():
            raise MlxformerError(f"--models-dir {folder} is not a directory")
        for path in sorted(folder.iterdir()):
            parts = split_part_names(path.name)
            is_gguf = path.suffix.lower() == ".gguf" and not path.name.lower().startswith("mmproj") and (
                parts is None or parts[0] == path.name)
            if is_gguf or (path / "config.json").is_file():
                sources.setdefault(model_name(str(path)), str(path))
    if args.models_from_cache:
        from mlxformer.formats.hub_cache import cached_models

        for cached in cached_models():
            if cached.loadable:
                sources.setdefault(cached.name, str(cached.path))
    if (args.models_dir or args.models_from_cache) and not sources:
        raise MlxformerError("no loadable model found (--models-dir / --models-from-cache)")
    return sources


def run_several(args: argparse.Namespace, sources: dict[str, str], settings: Any, max_kv_memory: Any,
                prompt_cache: Any, sock: Any) -> int:
    """``serve`` with several models: each loaded on first use (``server/hosts.py``)."""
    from mlxformer.engine import Engine
    from mlxformer.errors import MlxformerError
    from mlxformer.loader import load
    from mlxformer.models.config import FLOAT_DTYPES
    from mlxformer.server.app import create_app
    from mlxformer.server.model_facts import parse_loaded_memory
    from mlxformer.server.multi_app import serve_models
    from mlxformer.server.runner import served_hosts
    from mlxformer.server.translate import ServedModel

    if args.max_loaded_models < 1:
        raise MlxformerError("--max-loaded-models must be at least 1")
    if args.idle_unload is not None and not args.idle_unload >= 0:
        raise MlxformerError("--idle-unload must be >= 0 seconds")
    if speculates(args):
        raise MlxformerError("speculative decoding is not supported with several models")
    hosts = served_hosts(args.host, args.allowed_host)
    extra = {"max_body_bytes": args.max_body_bytes} if args.max_body_bytes is not None else {}

    def make_app(name: str, source: str, host: Any) -> tuple[Any, Callable[[], None]]:
        model, tokenizer = load(source, dtype=FLOAT_DTYPES[args.dtype] if args.dtype else None, threads=args.threads)
        apply_pooling(model, args.pooling)
        engine = Engine(model, tokenizer, max_batch=args.max_batch, max_queue=args.max_queue, cache_settings=settings,
                        prompt_cache=prompt_cache, max_kv_memory=max_kv_memory)
        app = create_app(engine, ServedModel.of(name, model, tokenizer), api_key=args.api_key,
                         cors_origins=args.cors_origin, allowed_hosts=hosts,
                         openapi=not args.no_openapi, tool_parser=args.tool_parser,
                         any_model_name=not args.strict_model_names, sse_ping_seconds=args.sse_ping_seconds or None,
                         host=lambda ctx: host, **extra)
        engine.start()
        return app, engine.stop

    max_memory = parse_loaded_memory(args.max_loaded_memory) if args.max_loaded_memory is not None else None
    serve_models(sources, make_app, host=args.host, port=args.port, max_loaded=args.max_loaded_models,
                 max_memory=max_memory, max_kv_memory=max_kv_memory, tool_parser=args.tool_parser,
                 idle_unload=args.idle_unload, strict=args.strict_model_names, api_key=args.api_key,
                 allowed_hosts=hosts, sock=sock, **extra)
    return 0
