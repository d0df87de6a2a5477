"""Sampling as small pure array functions over a batch of rows.

Every function takes log-probabilities or logits ``(B, vocab)`` and per-row settings as ``(B,)``
vectors (a Python number stands for the same value in every row), so a batch with different
settings per row is one graph whose size does not depend on ``B``. Logits are cast to float32
once, before anything is accumulated (softmax and cumsum in bfloat16 lose the tail: top-p 0.95
kept 20 tokens of SmolLM2's instead of 2,229). ``mlxformer.sampling.choosing`` assembles these into a
decode step's choice; ``make_sampler``/``make_distribution`` are the one-setting forms.

Filters, in llama.cpp's order (the filters see the untempered distribution): top-k (exactly
``k`` tokens, ties broken by position), top-p over the mass renormalised after top-k (the most
likely token always stays), min-p (relative to the top token), then the temperature.
The values are validated by ``mlxformer.sampling.options.SamplingSettings``, nowhere else.
"""

from __future__ import annotations

import math
from typing import Callable, Protocol

import mlx.core as mx

from mlxformer.sampling.options import SamplingSettings

Sampler = Callable[[mx.array], mx.array]
LogitsProcessor = Callable[[mx.array, mx.array], mx.array]
Distribution = Callable[[mx.array], mx.array]  # logits (B, vocab) -> probabilities (B, vocab)
Setting = float | mx.array  # one value for every row, or one per row (B,)


class TokenConstraint(Protocol):
    """A per-sequence constraint on which tokens may come next (structured output).

    The generation loop asks for ``next_mask()`` before sampling each token, masks the
    disallowed logits to ``-inf``, and reports the chosen token with ``advance``.
    """

    def next_mask(self) -> mx.array | None:
        """Bool ``(vocab,)`` of the tokens allowed next (EOS included only where the grammar
        may end), or ``None`` when nothing is constrained at this step."""
        ...

    def advance(self, token: int) -> None:
        """Record that ``token`` was generated."""
        ...

    @property
    def done(self) -> bool:
        """Whether the output is complete: generation must stop here."""
        ...

REPETITION_CONTEXT = 64  # how many recent tokens the repetition penalty looks at (llama.cpp's repeat_last_n)


def logsumexp(x: mx.array) -> mx.array:
    """``log(sum(exp(x)))`` over the last axis (kept, size 1), accurate to ~1e-6 in float32.

    MLX's CPU backend sums a row one element after another, so over a 49k vocabulary the tail's
    small terms round away and ``mx.logsumexp`` comes out 1e-4 to 2.5e-4 low. Here it runs over
    blocks of about sqrt(vocab) (the row padded with -inf), then over the block results: no
    running sum gets long, and it costs what one ``mx.logsumexp`` does. No host sync."""
    vocab = x.shape[-1]
    block = 1 << math.ceil(math.log2(max(vocab, 1)) / 2)  # a power of two >= sqrt(vocab)
    if vocab % block:
        x = mx.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, -vocab % block)], constant_values=-mx.inf)
    blocks = mx.logsumexp(x.reshape(*x.shape[:-1], -1, block), axis=-1)  # (..., vocab / block)
    return mx.logsumexp(blocks, axis=-1, keepdims=True)


def normalize(logits: mx.array) -> mx.array:
    """Float32 log-probabilities ``(B, vocab)`` from logits in any dtype (``logsumexp``)."""
    logits = logits.astype(mx.float32)
    return logits - logsumexp(logits)


def greedy(logprobs: mx.array) -> mx.array:
    """The most likely token."""
    return mx.argmax(logprobs, axis=-1)


def _column(value: Setting, dtype: mx.Dtype) -> mx.array:
    """A setting as a ``(B, 1)`` column (or a scalar array) broadcasting against ``(B, vocab)``."""
    return value.astype(dtype)[:, None] if isinstance(value, mx.array) else mx.array(value, dtype)


def _keep(logprobs: mx.array, top_k: mx.array, top_p: mx.array, min_p: mx.array) -> mx.array:
    """Bool ``(B, vocab)``: the tokens top-k, then top-p, then min-p keep (columns ``(B, 1)``;
    ``top_k`` >= vocab and ``top_p`` >= 1 are off). Shape-free, so it compiles shapeless."""
    order = mx.argsort(-logprobs, axis=-1)  # (B, vocab) descending, ties by position
    ranked = mx.take_along_axis(logprobs, order, axis=-1)
    rank = mx.cumsum(mx.ones_like(order), axis=-1)  # 1-based
    keep = rank <= top_k
    # Top-p over the mass left by top-k: a token stays while the mass strictly above it is below
    # top_p (exactly 0 for the first token, which always stays). The mass is summed from the
    # least likely token up: adding thousands of tiny tail probabilities to a running total near 1
    # rounds each away in float32 (top-p 0.95 on SmolLM2 kept 3,980 tokens instead of 3,990).
    # (not softmax: its sum rounds the same way, off by 1.4e-4 there)
    weights = mx.where(keep, mx.exp(ranked - mx.max(ranked, axis=-1, keepdims=True)), 0.0)
    mass_from = mx.cumsum(weights, axis=-1, reverse=True)  # unnormalised mass at and below each rank
    total = mx.max(mass_from, axis=-1, keepdims=True)  # the first rank's: everything top-k kept
    # The first rank always stays: a top_p that float32 rounds to 0 (1e-46) kept nothing.
    keep = keep & ((total - mass_from < top_p * total) | (top_p >= 1.0) | (rank == 1))
    keep = keep & (ranked >= mx.max(ranked, axis=-1, keepdims=True) + mx.log(min_p))
    return mx.put_along_axis(mx.zeros_like(keep), order, keep, axis=-1)


_keep_compiled = mx.compile(_keep, shapeless=True)


def keep_mask(logprobs: mx.array, top_k: Setting = 0, top_p: Setting = 1.0, min_p: Setting = 0.0) -> mx.array:
    """Bool ``(B, vocab)`` of the tokens the filters keep from float32 ``logprobs`` (``top_k`` 0: off)."""
    vocab = logprobs.shape[-1]
    k = mx.where(top_k > 0, mx.minimum(top_k, vocab), vocab) if isinstance(top_k, mx.array) else (
        top_k if 0 < top_k < vocab else vocab)
    return _keep_compiled(logprobs, _column(k, mx.int32), _column(top_p, mx.float32), _column(min_p, mx.float32))


def filtered(logprobs: mx.array, temp: Setting, top_k: Setting = 0, top_p: Setting = 1.0, min_p: Setting = 0.0
             ) -> mx.array:
    """The logits a sampler draws from: the kept tokens' log-probabilities over ``temp`` (> 0)."""
    kept = mx.where(keep_mask(logprobs, top_k, top_p, min_p), logprobs, -mx.inf)
    return kept / _column(temp, mx.float32)


def draw(logits: mx.array, keys: mx.array | None = None) -> mx.array:
    """One token per row ``(B,)`` from ``softmax(logits)``: the Gumbel-max draw, each row with its
    own key from ``keys`` ``(B, 2)`` (so a row draws what it draws in any batch), or MLX's global
    stream for ``None``."""
    if keys is None:
        return mx.random.categorical(logits, axis=-1)
    vocab = logits.shape[-1]
    noise = mx.vmap(lambda key: mx.random.gumbel((vocab,), key=key))(keys)  # (B, vocab)
    return mx.argmax(logits + noise, axis=-1)


def top_logprobs(logprobs: mx.array, n: int) -> tuple[mx.array, mx.array]:
    """The ``n`` most likely tokens of each row, most likely first: ids and values ``(B, n)``
    (a partition then a sort of ``n``, not a sort of the vocabulary)."""
    ids = mx.argpartition(-logprobs, kth=n - 1, axis=-1)[:, :n] if n < logprobs.shape[-1] else None
    values = mx.take_along_axis(logprobs, ids, axis=-1) if ids is not None else logprobs
    order = mx.argsort(-values, axis=-1)  # (B, n)
    ids = mx.take_along_axis(ids, order, axis=-1) if ids is not None else order
    return ids, mx.take_along_axis(values, order, axis=-1)


def keep_top_k(logprobs: mx.array, k: int) -> mx.array:
    """Mask all but the ``k`` most likely tokens."""
    return mx.where(keep_mask(logprobs, top_k=k), logprobs, -mx.inf)


def keep_top_p(logprobs: mx.array, top_p: float) -> mx.array:
    """Nucleus filtering: keep the smallest set of most likely tokens whose mass reaches ``top_p``
    (the most likely token always stays, however small ``top_p``)."""
    return mx.where(keep_mask(logprobs, top_p=top_p), logprobs, -mx.inf)


def keep_min_p(logprobs: mx.array, min_p: float) -> mx.array:
    """Keep tokens whose probability is at least ``min_p`` times the top token's."""
    return mx.where(keep_mask(logprobs, min_p=min_p), logprobs, -mx.inf)


def sampling_logits(logprobs: mx.array, temp: float, top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0) -> mx.array:
    """The logits a non-greedy sampler draws from (``filtered`` with one setting for every row)."""
    return filtered(logprobs.astype(mx.float32), temp, top_k, top_p, min_p)


def make_sampler(temp: float = 0.0, top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0) -> Sampler:
    """Greedy at ``temp == 0`` (or below ``GREEDY_BELOW``); otherwise top-k, top-p and min-p
    filtering, then temperature sampling (bad values raise ``OptionError``)."""
    if SamplingSettings(temp=temp, top_p=top_p, top_k=top_k, min_p=min_p).greedy:
        return greedy

    def sample(logprobs: mx.array, key: mx.array | None = None) -> mx.array:
        # ``key``: a PRNG key (2,) for this draw, shared by the rows; None uses the global stream.
        logits = sampling_logits(logprobs, temp, top_p, top_k, min_p)
        return mx.random.categorical(logits, axis=-1, key=key)

    return sample


def make_distribution(temp: float, top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0) -> Distribution:
    """The probabilities ``make_sampler(temp, ...)`` draws from (``temp > 0``), from logits."""
    if SamplingSettings(temp=temp, top_p=top_p, top_k=top_k, min_p=min_p).greedy:
        raise ValueError("a sampling distribution needs temp > 0")

    def distribution(logits: mx.array) -> mx.array:
        return mx.softmax(filtered(normalize(logits), temp, top_k, top_p, min_p), axis=-1)

    return distribution


# --- penalties ------------------------------------------------------------------------------


def token_counts(ids: mx.array, vocab: int) -> mx.array:
    """How often each token occurs in each row of ``ids`` ``(B, n)`` (padding: ids >= ``vocab``):
    float32 ``(B, vocab)``."""
    rows = mx.arange(ids.shape[0])[:, None]  # (B, 1)
    counts = mx.zeros((ids.shape[0], vocab + 1), mx.float32).at[rows, mx.minimum(ids, vocab)].add(1.0)
    return counts[:, :vocab]


def repetition_penalized(logits: mx.array, recent: mx.array, penalty: Setting) -> mx.array:
    """CTRL-style penalty on the tokens of ``recent`` ``(B, n)`` (padded with ids >= vocab):
    positive logits divided by ``penalty``, negative multiplied (1: off)."""
    seen = token_counts(recent, logits.shape[-1]) > 0
    penalty = _column(penalty, mx.float32)
    return mx.where(seen, mx.where(logits > 0, logits / penalty, logits * penalty), logits)


def occurrence_penalized(logits: mx.array, counts: mx.array, presence: Setting, frequency: Setting) -> mx.array:
    """OpenAI's presence and frequency penalties from each row's generated-token ``counts``
    ``(B, vocab)`` (``token_counts``)."""
    return logits - (_column(frequency, mx.float32) * counts + _column(presence, mx.float32) * (counts > 0))


def repetition_penalty_processor(penalty: float, context: int = REPETITION_CONTEXT) -> LogitsProcessor:
    """The repetition penalty over the last ``context`` tokens of a history ``(n,)``, for one row."""
    SamplingSettings(repetition_penalty=penalty)

    def process(history: mx.array, logits: mx.array) -> mx.array:
        recent = mx.broadcast_to(history[-context:][None], (logits.shape[0], min(history.size, context)))
        return repetition_penalized(logits.astype(mx.float32), recent, penalty)

    return process


def penalty_processor(
    presence: float, frequency: float, bias: dict[int, float] | None, prompt_length: int
) -> LogitsProcessor:
    """Presence/frequency penalties over ``history`` after its first ``prompt_length``, plus the logit bias."""

    def process(history: mx.array, logits: mx.array) -> mx.array:
        logits = logits.astype(mx.float32)
        generated = mx.broadcast_to(history[prompt_length:][None], (logits.shape[0], max(history.size - prompt_length, 0)))
        logits = occurrence_penalized(logits, token_counts(generated, logits.shape[-1]), presence, frequency)
        if bias:
            logits = logits.at[:, mx.array(list(bias))].add(mx.array(list(bias.values()), mx.float32))
        return logits

    return process


def make_logits_processors(sampling: SamplingSettings, prompt_length: int = 0) -> list[LogitsProcessor]:
    """The processors ``sampling`` asks for, one row at a time (none for default settings);
    ``prompt_length`` is where the generated tokens start in the history they are given."""
    processors = []
    if sampling.repetition_penalty is not None and sampling.repetition_penalty != 1.0:
        processors.append(repetition_penalty_processor(sampling.repetition_penalty))
    if sampling.presence_penalty or sampling.frequency_penalty or sampling.logit_bias:
        processors.append(penalty_processor(
            sampling.presence_penalty, sampling.frequency_penalty, dict(sampling.logit_bias or {}), prompt_length))
    return processors
