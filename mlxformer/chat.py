"""A multi-turn chat session that keeps the KV cache between turns.

Each turn renders the whole conversation with the chat template, keeps the cached tokens that
are a prefix of it (trimming the cache back to the common prefix when the re-rendered reply
tokenizes differently), and prefills only the rest.
"""

from __future__ import annotations

import dataclasses
from typing import Iterator, Sequence

from mlxformer.cache import Cache, CacheSettings, make_cache
from mlxformer.errors import MlxformerError
from mlxformer.generation import GenerationResponse, SamplingSettings, stream_generate
from mlxformer.models.decoder import Model
from mlxformer.speculative import SpeculativeSettings
from mlxformer.cache.files import load_prompt_cache_file, save_prompt_cache
from mlxformer.tokenizer import Tokenizer

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
        speculative: SpeculativeSettings | None = None,
    ) -> None:
        if not tokenizer.chat_template:
            raise MlxformerError("chat needs a model whose tokenizer has a chat template")
        self.model, self.tokenizer = model, tokenizer
        if speculative is not None:  # rotating caches keep enough beyond their window to rewind
            cache_settings = dataclasses.replace(cache_settings or CacheSettings(), rewind=speculative.num_draft_tokens)
        self.system, self.sampling, self.settings = system, sampling, cache_settings
        self.max_tokens, self.stop, self.speculative = max_tokens, tuple(stop), speculative
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
                sampling=self.sampling, stop=self.stop, cache=self.cache, speculative=self.speculative,
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
        save_prompt_cache(path, self.cache, self.cached_ids, self.model, self.tokenizer, messages=self.messages)

    def load(self, path: str) -> None:
        """Restore a cache, its token ids and the conversation saved by ``save`` (with this
        model and tokenizer; the session's explicit cache settings must be the file's)."""
        loaded = load_prompt_cache_file(path, self.model, self.tokenizer, self.settings)
        self.cache, self.cached_ids = loaded.cache, loaded.token_ids
        self.messages = loaded.messages

    def stats(self) -> str:
        """One line: context tokens, cache memory and the last turn's prefill."""
        return (
            f"context: {len(self.cached_ids)} tokens | cache: {self.cache_nbytes / 1e6:.2f} MB | "
            f"last prefill: {self.last_prefill_tokens} tokens"
        )
