"""Sampling as small pure functions, composed once by ``make_sampler``.

A sampler maps log-probabilities ``(B, vocab)`` to token ids ``(B,)``; a logits processor
maps ``(history, logits)`` to new logits (a new array: the caller's is never modified).
The values are validated by ``mlxformer.options.SamplingSettings``, nowhere else.
"""

from __future__ import annotations

from typing import Callable, Protocol

import mlx.core as mx

from mlxformer.options import SamplingSettings

Sampler = Callable[[mx.array], mx.array]
LogitsProcessor = Callable[[mx.array, mx.array], mx.array]
Distribution = Callable[[mx.array], mx.array]  # logits (B, vocab) -> probabilities (B, vocab)


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


def greedy(logprobs: mx.array) -> mx.array:
    """The most likely token."""
    return mx.argmax(logprobs, axis=-1)


def keep_top_k(logprobs: mx.array, k: int) -> mx.array:
    """Mask all but the ``k`` most likely tokens."""
    if k <= 0 or k >= logprobs.shape[-1]:
        return logprobs
    dropped = mx.argpartition(-logprobs, kth=k - 1, axis=-1)[..., k:]
    return mx.put_along_axis(logprobs, dropped, mx.array(-float("inf"), logprobs.dtype), axis=-1)


def keep_top_p(logprobs: mx.array, top_p: float) -> mx.array:
    """Nucleus filtering: keep the smallest set of most likely tokens whose mass reaches ``top_p``.

    The mass is measured after renormalising the tokens still kept (e.g. by top-k), as
    transformers and llama.cpp do. The most likely token always stays, however small ``top_p``.
    """
    if top_p >= 1.0:
        return logprobs
    order = mx.argsort(-logprobs, axis=-1)  # descending
    sorted_probs = mx.softmax(mx.take_along_axis(logprobs, order, axis=-1), axis=-1)
    # A token is kept when the mass strictly above it is below top_p: an exclusive cumsum,
    # exactly 0 for the first token (``1 - cumsum`` from the other end rounds on a large vocabulary).
    mass_above = mx.cumsum(sorted_probs, axis=-1) - sorted_probs
    keep_sorted = mass_above < top_p
    keep_sorted = mx.concatenate([mx.ones_like(keep_sorted[..., :1]), keep_sorted[..., 1:]], axis=-1)
    keep = mx.put_along_axis(mx.zeros_like(keep_sorted), order, keep_sorted, axis=-1)
    return mx.where(keep, logprobs, -float("inf"))


def keep_min_p(logprobs: mx.array, min_p: float) -> mx.array:
    """Keep tokens whose probability is at least ``min_p`` times the top token's."""
    if min_p <= 0.0:
        return logprobs
    threshold = mx.max(logprobs, axis=-1, keepdims=True) + mx.log(mx.array(min_p, logprobs.dtype))
    return mx.where(logprobs >= threshold, logprobs, -float("inf"))


def make_sampler(temp: float = 0.0, top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0) -> Sampler:
    """Greedy at ``temp == 0``; otherwise top-k, top-p and min-p filtering, then temperature sampling
    (bad values raise ``OptionError``)."""
    SamplingSettings(temp=temp, top_p=top_p, top_k=top_k, min_p=min_p)
    if temp == 0:
        return greedy

    def sample(logprobs: mx.array, key: mx.array | None = None) -> mx.array:
        # ``key``: a PRNG key for this draw (per-sequence streams); None uses the global one.
        return mx.random.categorical(sampling_logits(logprobs, temp, top_p, top_k, min_p), axis=-1, key=key)

    return sample


def sampling_logits(logprobs: mx.array, temp: float, top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0) -> mx.array:
    """The logits a non-greedy sampler draws from: top-k, then top-p, then min-p, then the
    temperature (llama.cpp's order: the filters see the untempered distribution)."""
    logprobs = keep_min_p(keep_top_p(keep_top_k(logprobs, top_k), top_p), min_p)
    return logprobs * (1.0 / temp)


def make_distribution(temp: float, top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0) -> Distribution:
    """The probabilities ``make_sampler(temp, ...)`` draws from (``temp > 0``), from logits."""
    if SamplingSettings(temp=temp, top_p=top_p, top_k=top_k, min_p=min_p).greedy:
        raise ValueError("a sampling distribution needs temp > 0")

    def distribution(logits: mx.array) -> mx.array:
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        return mx.softmax(sampling_logits(logprobs, temp, top_p, top_k, min_p), axis=-1)

    return distribution


def repetition_penalty_processor(penalty: float, context: int = REPETITION_CONTEXT) -> LogitsProcessor:
    """CTRL-style penalty on the last ``context`` tokens: positive logits divided, negative multiplied."""
    SamplingSettings(repetition_penalty=penalty)

    def process(history: mx.array, logits: mx.array) -> mx.array:
        recent = history[-context:]
        if recent.size == 0:
            return logits
        columns = mx.broadcast_to(recent[None], (logits.shape[0], recent.size))  # (B, n)
        selected = mx.take_along_axis(logits, columns, axis=-1)
        penalized = mx.where(selected > 0, selected / penalty, selected * penalty)
        return mx.put_along_axis(logits, columns, penalized, axis=-1)  # a new array

    return process


def penalty_processor(
    presence: float, frequency: float, bias: dict[int, float] | None, prompt_length: int
) -> LogitsProcessor:
    """OpenAI's presence/frequency penalties over the generated tokens (``history`` after its
    first ``prompt_length``), plus the logit bias."""
    bias_ids = mx.array(list(bias), dtype=mx.int32) if bias else None
    bias_values = mx.array(list(bias.values()), dtype=mx.float32) if bias else None

    def process(history: mx.array, logits: mx.array) -> mx.array:
        generated = history[prompt_length:]
        if generated.size and (presence or frequency):
            counts = mx.zeros((logits.shape[-1],), mx.float32).at[generated].add(1.0)
            logits = logits - (frequency * counts + presence * (counts > 0)).astype(logits.dtype)
        if bias_ids is not None and bias_values is not None:
            logits = logits.at[:, bias_ids].add(bias_values.astype(logits.dtype))
        return logits

    return process


def make_logits_processors(sampling: SamplingSettings, prompt_length: int = 0) -> list[LogitsProcessor]:
    """The processors ``sampling`` asks for (none for default settings); ``prompt_length`` is
    where the generated tokens start in the history the processors are given."""
    processors = []
    if sampling.repetition_penalty is not None and sampling.repetition_penalty != 1.0:
        processors.append(repetition_penalty_processor(sampling.repetition_penalty))
    if sampling.presence_penalty or sampling.frequency_penalty or sampling.logit_bias:
        processors.append(penalty_processor(
            sampling.presence_penalty, sampling.frequency_penalty, dict(sampling.logit_bias or {}), prompt_length))
    return processors
