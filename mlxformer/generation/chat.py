"""A multi-turn chat session that keeps the KV cache between turns.

Each turn renders the whole conversation with the chat template, keeps the cached tokens that
are a prefix of it (trimming the cache back to the common prefix when the re-rendered reply
tokenizes differently), and decodes a ``DecodingState`` over the whole conversation, so that
only the rest is prefilled and a speculation proposer sees every earlier turn (a draft model
keeps its own cache across turns too). After each turn the cache holds exactly the tokens
the state handed out but the last (``DecodingState.settle``).
"""

from __future__ import annotations

from typing import Iterator, Sequence

from mlxformer.cache import Cache, CacheSettings, make_cache
from mlxformer.generation.prompt_cache_files import load_prompt_cache_file, save_prompt_cache
from mlxformer.generation.decoding import open_sequence, with_rewind
from mlxformer.errors import MlxformerError
from mlxformer.generation.stream import GenerationResponse, decode, responses
from mlxformer.models.decoder import Model
from mlxformer.sampling.options import SamplingSettings, checked, checked_sampling
from mlxformer.speculative.speculator import SpeculativeSettings, check_draft, new_proposer, trim_to_common_prefix
from mlxformer.text.tokenizer import Tokenizer


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
        if speculative is not None:
            check_draft(speculative, tokenizer)
        self.system, self.sampling = system, checked_sampling(sampling)
        self.settings = checked("cache_settings", cache_settings, CacheSettings)
        self.max_tokens, self.stop, self.speculative = max_tokens, tuple(stop), speculative
        self.reset()

    def reset(self) -> None:
        """Forget the conversation and empty the cache."""
        self.messages: list[dict[str, str]] = [{"role": "system", "content": self.system}] if self.system else []
        self._forget_cache()
        self.last_prefill_tokens = 0  # tokens the last turn prefilled (none since the reset)

    def _forget_cache(self) -> None:
        """Start from an empty cache (and a new proposer): the next turn prefills the whole conversation."""
        self.cache: list[Cache] = self._new_cache()
        self.cached_ids: list[int] = []  # the tokens the cache holds, in order
        self.proposer = new_proposer(self.speculative, self.settings) if self.speculative is not None else None

    def _new_cache(self) -> list[Cache]:
        return make_cache(self.model, with_rewind(self.settings, self.speculative))

    @property
    def cache_nbytes(self) -> int:
        """Bytes held by the KV cache."""
        return sum(c.nbytes for c in self.cache)

    def _reuse_cached_prefix(self, ids: list[int]) -> int:
        """Trim the cache to the longest cached prefix of ``ids`` (leaving one id to prefill)."""
        keep = trim_to_common_prefix(self.cache, self.cached_ids, ids)
        if keep is None:  # e.g. a rotating cache that already evicted tokens
            self.cache, keep = self._new_cache(), 0
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
        state = open_sequence(
            self.model, ids, eos_ids=self.tokenizer.eos_token_ids, detokenizer=self.tokenizer.detokenizer(),
            sampling=self.sampling, max_tokens=self.max_tokens, stop=self.stop, cache=self.cache,
            speculative=self.speculative, proposer=self.proposer, cache_settings=self.settings,
        )
        pieces: list[str] = []
        tokens = decode(self.model, state)
        interrupted = False
        try:
            for response in responses(state, tokens):
                pieces.append(response.text)
                yield response
        except KeyboardInterrupt:  # Ctrl-C mid-step: the cache may hold more than the state handed out
            interrupted = True
            raise
        finally:
            tokens.close()  # settles the state, also when the caller stopped early
            self.cached_ids = state.cache_tokens
            self.messages = messages + [{"role": "assistant", "content": "".join(pieces)}]
            if interrupted:
                self._forget_cache()

    def save(self, path: str, overwrite: bool = True) -> None:
        """Save the cache, its token ids and the conversation (an existing ``path`` only with ``overwrite``)."""
        save_prompt_cache(path, self.cache, self.cached_ids, self.model, self.tokenizer, messages=self.messages,
                          overwrite=overwrite)

    def load(self, path: str) -> None:
        """Restore a cache, its token ids and the conversation saved by ``save`` (with this
        model and tokenizer; the session's explicit cache settings must be the file's)."""
        loaded = load_prompt_cache_file(path, self.model, self.tokenizer, self.settings)
        if loaded.token_ids and not loaded.messages:  # its prompt is an open user turn, not a conversation
            raise MlxformerError(f"{path} holds a prompt saved by cache-prompt, not a conversation: "
                                 "use it with 'mlxformer generate --prompt-cache-file'")
        self.cache, self.cached_ids = loaded.cache, loaded.token_ids
        self.messages = loaded.messages

    def stats(self) -> str:
        """One line: context tokens, cache memory and the last turn's prefill."""
        return (
            f"context: {len(self.cached_ids)} tokens | cache: {self.cache_nbytes / 1e6:.2f} MB | "
            f"last prefill: {self.last_prefill_tokens} tokens"
        )
