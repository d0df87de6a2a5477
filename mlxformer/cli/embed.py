"""``mlxformer embed``: embeddings of texts (arguments, or stdin's lines) as JSON lines; with
``--rerank QUERY``, the texts' relevance to QUERY instead, most relevant first."""

from __future__ import annotations

import argparse
import json
import sys

from mlxformer.cli.common import add_model_args, add_verbose, load_for_cli

POOLINGS = ("last", "mean", "cls")  # mlxformer.embeddings.head.POOLINGS (the CLI imports no library module up front)


def add_pooling_arg(parser: argparse.ArgumentParser) -> None:
    """``--pooling``, shared with ``serve``."""
    parser.add_argument("--pooling", choices=POOLINGS,
                        help="how embeddings pool the hidden states (default: the checkpoint's sentence-transformers "
                             "or GGUF setting, else the last token)")


def apply_pooling(model: object, pooling: str | None) -> None:
    """Set ``--pooling`` on a loaded model's embedding head."""
    from mlxformer.embeddings.head import with_pooling

    model.embedding_head = with_pooling(model.embedding_head, pooling)  # type: ignore[attr-defined]


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``embed`` subcommand."""
    parser = subparsers.add_parser("embed", help="embed texts (one JSON vector a line), or rerank them for a query")
    add_model_args(parser)
    parser.add_argument("texts", nargs="*", metavar="TEXT", help="texts to embed (default: each line of stdin)")
    add_pooling_arg(parser)
    parser.add_argument("--prompt-name", metavar="NAME",
                        help="put the model's prompt NAME before each text (e.g. query: Qwen3-Embedding's instruction)")
    parser.add_argument("--dimensions", type=int, metavar="N", help="keep the first N features, normalized (Matryoshka)")
    parser.add_argument("--rerank", metavar="QUERY",
                        help="print each text's relevance to QUERY, most relevant first (a reranker model)")
    add_verbose(parser)
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """Handler of ``mlxformer embed``."""
    from mlxformer.embeddings.encode import embed
    from mlxformer.embeddings.rerank import rerank
    from mlxformer.errors import MlxformerError

    texts = args.texts or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    if not texts:
        raise MlxformerError("no texts to embed (give them as arguments or on stdin)")
    model, tokenizer = load_for_cli(args)
    apply_pooling(model, args.pooling)
    if args.rerank is not None:
        scores = rerank(model, tokenizer, args.rerank, texts)
        for index in sorted(range(len(texts)), key=lambda i: -scores[i]):
            print(json.dumps({"index": index, "relevance_score": scores[index], "document": texts[index]}))
        return 0
    for vector in embed(model, tokenizer, texts, prompt_name=args.prompt_name, dimensions=args.dimensions):
        print(json.dumps([round(float(x), 7) for x in vector]))
    return 0
