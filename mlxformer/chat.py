"""``mlxformer chat``: a multi-turn REPL that keeps the KV cache between turns.

Each turn renders the whole conversation with the chat template, keeps the cached tokens that
are a prefix of it (trimming the cache back to the common prefix when the re-rendered reply
tokenizes differently), and prefills only the rest.
"""

from __future__ import annotations

import argparse
import sys
from typing import Iterator, Sequence, TextIO

from .cache import Cache, CacheSettings, make_cache
from .cli import add_cache_args, add_model_args, add_sampling_args, cache_settings, load_for_cli, sampling_settings
from .errors import MlxformerError
from .generate import GenerationResponse, SamplingSettings, stream_generate
from .model import Model
from .prompt_cache import load_prompt_cache_file, save_prompt_cache
from .tokenizer import Tokenizer

HELP = "commands: /reset, /save FILE, /load FILE, /stats, /help, /exit"


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading ids ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class ChatSession:
    """A conversation plus the KV cache of its tokens; ``send`` streams one assistant reply."""

    def __init__(
        self,
        model: Model,
        tokenizer: Tokenizer,
        *,
        system: str | None = None,
        sampling: SamplingSettings = SamplingSettings(),
        cache_settings: CacheSettings | None = None,
        max_tokens: int = 256,
        stop: Sequence[str] = (),
    ) -> None:
        if not tokenizer.chat_template:
            raise MlxformerError("chat needs a model whose tokenizer has a chat template")
        self.model, self.tokenizer = model, tokenizer
        self.system, self.sampling, self.settings = system, sampling, cache_settings
        self.max_tokens, self.stop = max_tokens, tuple(stop)
        self.last_prefill_tokens = 0
        self.reset()

    def reset(self) -> None:
        """Forget the conversation and empty the cache."""
        self.messages: list[dict[str, str]] = [{"role": "system", "content": self.system}] if self.system else []
        self.cache: list[Cache] = make_cache(self.model, self.settings)
        self.cached_ids: list[int] = []  # the tokens the cache holds, in order

    @property
    def cache_nbytes(self) -> int:
        """Bytes held by the KV cache."""
        return sum(c.nbytes for c in self.cache)

    def _reuse_cached_prefix(self, ids: list[int]) -> int:
        """Trim the cache to the longest cached prefix of ``ids`` (leaving one id to prefill)."""
        keep = min(common_prefix_length(ids, self.cached_ids), len(ids) - 1)
        drop = len(self.cached_ids) - keep
        if drop > 0:
            trimmed = [c.trim(drop) for c in self.cache]
            if any(n != drop for n in trimmed):  # e.g. a rotating cache that already evicted tokens
                self.cache = make_cache(self.model, self.settings)
                keep = 0
        self.cached_ids = self.cached_ids[:keep]
        return keep

    def send(self, user_text: str) -> Iterator[GenerationResponse]:
        """Stream the reply to ``user_text``; the conversation and cache advance as it streams."""
        messages = self.messages + [{"role": "user", "content": user_text}]
        rendered = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        ids = self.tokenizer.encode(rendered, add_special_tokens=False)
        if not ids:
            raise MlxformerError("the chat template rendered an empty prompt")
        reused = self._reuse_cached_prefix(ids)
        self.last_prefill_tokens = len(ids) - reused
        pieces: list[str] = []
        tokens: list[int] = []
        try:
            for response in stream_generate(
                self.model, self.tokenizer, ids[reused:], self.max_tokens,
                sampling=self.sampling, stop=self.stop, cache=self.cache,
            ):
                pieces.append(response.text)
                if response.token is not None:
                    tokens.append(response.token)
                yield response
        finally:
            # The cache holds the prompt and every reply token fed back so far (offset says how many).
            self.cached_ids = (ids + tokens)[: self.cache[0].offset]
            self.messages = messages + [{"role": "assistant", "content": "".join(pieces)}]

    def save(self, path: str) -> None:
        """Save the cache, its token ids and the conversation."""
        save_prompt_cache(path, self.cache, self.cached_ids, self.model, messages=self.messages)

    def load(self, path: str) -> None:
        """Restore a cache, its token ids and the conversation saved by ``save``."""
        loaded = load_prompt_cache_file(path, self.model)
        self.cache, self.cached_ids = loaded.cache, loaded.token_ids
        self.messages = loaded.messages

    def stats(self) -> str:
        """One line: context tokens, cache memory and the last turn's prefill."""
        return (
            f"context: {len(self.cached_ids)} tokens | cache: {self.cache_nbytes / 1e6:.2f} MB | "
            f"last prefill: {self.last_prefill_tokens} tokens"
        )


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
        session.save(arg)
        out.write(f"[saved {len(session.cached_ids)} tokens to {arg}]\n")
    elif name == "/load":
        session.load(arg)
        out.write(f"[loaded {len(session.cached_ids)} tokens, {len(session.messages)} messages from {arg}]\n")
    elif name == "/stats":
        out.write(session.stats() + "\n")
    else:
        out.write(HELP + "\n")
    return True


def run_repl(session: ChatSession, stdin: TextIO, stdout: TextIO) -> None:
    """Read lines from ``stdin`` until EOF or ``/exit``; stream each reply to ``stdout``."""
    interactive = stdin.isatty()
    while True:
        if interactive:
            stdout.write(">> ")
            stdout.flush()
        line = stdin.readline()
        if not line:
            break
        line = line.strip()
        if not line:
            continue
        try:
            if line.startswith("/"):
                if not _command(session, line, stdout):
                    break
                continue
            for response in session.send(line):
                stdout.write(response.text)
                stdout.flush()
            stdout.write("\n")
        except MlxformerError as exc:
            stdout.write(f"[error: {exc}]\n")
        stdout.flush()


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``chat`` subcommand."""
    parser = subparsers.add_parser("chat", help="chat interactively, reusing the KV cache between turns")
    add_model_args(parser)
    parser.add_argument("--system", help="system message")
    add_sampling_args(parser)
    add_cache_args(parser)
    parser.add_argument("--verbose", "-v", action="store_true", dest="verbose_sub", help="show tracebacks")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    sampling = sampling_settings(args)
    settings = cache_settings(args)
    model, tokenizer = load_for_cli(args)
    session = ChatSession(
        model, tokenizer, system=args.system, sampling=sampling, cache_settings=settings,
        max_tokens=args.max_tokens, stop=args.stop,
    )
    if sys.stdin.isatty():
        print(HELP, file=sys.stderr)
    run_repl(session, sys.stdin, sys.stdout)
    return 0
