"""``mlxformer chat``: a multi-turn REPL over ``mlxformer.generation.chat.ChatSession``."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, TextIO

from mlxformer.cli.common import (
    add_cache_args, add_model_args, add_sampling_args, add_speculative_args, add_verbose, cache_settings,
    check_output_path, load_for_cli, sampling_settings, speculative_settings,
)

if TYPE_CHECKING:
    from mlxformer.generation.chat import ChatSession

HELP = "commands: /reset, /save FILE [--force], /load FILE, /stats, /help, /exit"


def _command(session: ChatSession, line: str, out: TextIO) -> bool:
    """Run one slash command; False means leave the REPL."""
    name, _, arg = line.partition(" ")
    arg = arg.strip()
    if name in ("/exit", "/quit"):
        return False
    if name == "/reset":
        session.reset()
        out.write("[conversation reset]\n")
    elif name in ("/save", "/load") and not arg:
        out.write(f"usage: {name} FILE\n")
    elif name == "/save":
        force = arg.endswith(" --force")
        arg = arg.removesuffix(" --force").strip() if force else arg
        check_output_path(arg)
        session.save(arg, overwrite=force)
        out.write(f"[saved {len(session.cached_ids)} tokens to {arg}]\n")
    elif name == "/load":
        session.load(arg)
        out.write(f"[loaded {len(session.cached_ids)} tokens, {len(session.messages)} messages from {arg}]\n")
    elif name == "/stats":
        out.write(session.stats() + "\n")
    elif name == "/help":
        out.write(HELP + "\n")
    else:
        out.write(f"unknown command {name}; {HELP}\n")
    return True


def read_line(stdin: TextIO) -> str:
    """One line of ``stdin``. On a terminal it is awaited in short ``select`` waits: the SIGINT of
    Ctrl-C may go to one of MLX's threads, and a read blocked in the main thread would not see it
    until the next key."""
    if stdin.isatty():
        import select

        while not select.select([stdin], [], [], 0.2)[0]:
            pass
    return stdin.readline()


def run_repl(session: ChatSession, stdin: TextIO, stdout: TextIO) -> None:
    """Read lines from ``stdin`` until EOF (Ctrl-D) or ``/exit``; stream each reply to ``stdout``.
    Ctrl-C stops the reply being written (the conversation keeps what was said), or at the
    prompt says how to leave, as Ollama's REPL does."""
    from mlxformer.errors import MlxformerError

    interactive = stdin.isatty()
    while True:
        try:
            if interactive:
                stdout.write(">> ")
                stdout.flush()
            line = read_line(stdin)
        except KeyboardInterrupt:
            stdout.write("\n(Ctrl-D or /exit leaves the chat)\n")
            continue
        if not line:
            if interactive:
                stdout.write("\n")  # Ctrl-D: the shell's prompt starts on a line of its own
            break
        line = line.strip()
        if not line:
            continue
        try:
            if line.startswith("/"):
                if not _command(session, line, stdout):
                    break
                continue
            reply = session.send(line)
            try:
                for response in reply:
                    stdout.write(response.text)
                    stdout.flush()
            finally:
                reply.close()
            stdout.write("\n")
        except KeyboardInterrupt:  # Ctrl-C: this reply stops here, the chat goes on
            stdout.write("\n")
        except Exception as exc:  # reported; the conversation goes on
            prefix = "" if isinstance(exc, MlxformerError) else f"{type(exc).__name__}: "
            stdout.write(f"[error: {prefix}{exc}]\n")
        stdout.flush()


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``chat`` subcommand."""
    parser = subparsers.add_parser("chat", help="chat interactively, reusing the KV cache between turns")
    add_model_args(parser)
    parser.add_argument("--system", help="system message")
    add_sampling_args(parser)
    add_cache_args(parser)
    add_speculative_args(parser)
    add_verbose(parser)
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """Handler of ``mlxformer chat``."""
    from mlxformer.generation.chat import ChatSession

    sampling_settings(args)  # bad flags fail before the model loads
    settings = cache_settings(args)
    model, tokenizer = load_for_cli(args)
    sampling = sampling_settings(args, tokenizer.sampling_defaults)
    session = ChatSession(
        model, tokenizer, system=args.system, sampling=sampling, cache_settings=settings,
        max_tokens=args.max_tokens, stop=args.stop, speculative=speculative_settings(args, tokenizer, model),
    )
    if sys.stdin.isatty():
        print(HELP, file=sys.stderr)
    run_repl(session, sys.stdin, sys.stdout)
    return 0
