"""Sampling options: one dataclass, validated once, here, when it is made.

``SamplingSettings`` is how every entry point (``generate``/``stream_generate``, ``ChatSession``,
the engine's ``GenerationRequest``, the server, the CLI) says how the next token is chosen.
Making one with a bad value raises ``mlxformer.errors.OptionError``, whose ``param`` is the
field's name and whose ``message`` says what the value must be (``str(exc)`` is
``f"{param} {message}"``, e.g. ``"top_p must be a finite number in (0, 1] (got nan)"``). The
CLI shows it as ``--top-p must be ...``; the server maps it to a 400 whose ``param`` is the
API's name for the field (``temp`` is OpenAI's ``temperature``).

Fields and their rules (every float must be finite: NaN and infinities are refused):

- ``temp >= 0`` (0, or below ``GREEDY_BELOW``: greedy); ``0 < top_p <= 1`` (1: off; the most likely token always stays);
  ``0 <= top_k < 2**31`` (0: off; a k past the vocabulary keeps it whole); ``0 <= min_p < 1`` (0: off).
- ``repetition_penalty``: ``None`` (off) or ``> 0``, CTRL-style over the last 64 tokens.
- ``presence_penalty``, ``frequency_penalty`` in ``[-2, 2]`` (OpenAI's, over generated tokens).
- ``logit_bias``: ``{token id >= 0: bias in [-100, 100]}`` (ids are checked against the
  vocabulary by ``check_vocabulary``, which needs the model).
- ``seed``: ``None`` or ``-1`` (a random seed, llama.cpp's convention; ``seeded()`` draws one
  so it can be shown) or ``0 <= seed < 2**64`` (what ``mx.random.key`` accepts).

``check_number`` is the same rule for option values outside this dataclass (e.g. timeouts).
"""

from __future__ import annotations

import math
import random
import dataclasses
from dataclasses import dataclass, replace
from typing import Any, Iterable, Mapping

from mlxformer.errors import OptionError

MAX_SEED = 2**64 - 1  # mx.random.key takes an unsigned 64-bit seed
RANDOM_SEED = -1
# temperatures below this are greedy: a log-probability (>= -log(vocab)) over it stays finite in float32
GREEDY_BELOW = 1e-30
MAX_PENALTY = 2.0  # OpenAI's range for presence/frequency penalties
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for logit_bias values
MAX_INT32 = 2**31 - 1  # counts the sampling graph holds as int32 (top_k; a larger one is off anyway)


def check_number(
    param: str, value: float, *, low: float | None = None, high: float | None = None,
    low_open: bool = False, high_open: bool = False,
) -> float:
    """``value`` as a float if it is a finite number in the range, else ``OptionError(param)``.
    ``low``/``high`` bound it (``None``: unbounded), excluded when ``low_open``/``high_open``."""
    if low is not None and high is not None:
        rule = f"in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
    elif low is not None:
        rule = f"{'>' if low_open else '>='} {low:g}"
    elif high is not None:
        rule = f"{'<' if high_open else '<='} {high:g}"
    else:
        rule = ""
    message = f"must be a finite number {rule}".rstrip() + f" (got {value!r})"
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise OptionError(param, message)
    if low is not None and (value < low or (low_open and value == low)):
        raise OptionError(param, message)
    if high is not None and (value > high or (high_open and value == high)):
        raise OptionError(param, message)
    return float(value)


def check_integer(param: str, value: int, *, low: int, high: int | None = None) -> int:
    """``value`` if it is an integer in ``[low, high]``, else ``OptionError(param)``."""
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= low and (high is None or value <= high)
    if not ok:
        rule = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise OptionError(param, f"must be an integer {rule} (got {value!r})")
    return value


def check_strings(param: str, value: object, empty: bool = True) -> list[str]:
    """``value`` as a list of strings (one string: a list of it, not of its characters), else
    ``OptionError(param)``; ``empty=False``: at least one."""
    items = [value] if isinstance(value, str) else list(value) if isinstance(value, Iterable) else None
    if items is None or not all(isinstance(item, str) for item in items):
        raise OptionError(param, f"must be a string or a list of strings (got {value!r})")
    if not items and not empty:
        raise OptionError(param, "must hold at least one string")
    return items


def checked(param: str, value: Any, kind: type | tuple[type, ...]) -> Any:
    """``value`` if it is a ``kind`` (or None), else ``OptionError(param)`` (a dict of a
    settings class's fields is not one)."""
    if value is not None and not isinstance(value, kind):
        names = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
        raise OptionError(param, f"must be a {names} (got {type(value).__name__})")
    return value


def checked_sampling(value: object) -> "SamplingSettings":
    """``value`` if it is a ``SamplingSettings``, else ``OptionError``."""
    if value is None:
        raise OptionError("sampling", "must be a SamplingSettings (got NoneType)")
    return checked("sampling", value, SamplingSettings)


def sampling_with(sampling: object, fields: Mapping[str, Any]) -> "SamplingSettings":
    """``sampling`` (checked: ``checked_sampling``) with ``fields`` replaced, a keyword that is
    no field an ``OptionError`` (``generate(..., temp=0.7)``)."""
    known = {f.name for f in dataclasses.fields(SamplingSettings)}
    if unknown := sorted(set(fields) - known):
        raise OptionError(unknown[0], f"is not an option (sampling settings: {', '.join(sorted(known))})")
    return dataclasses.replace(checked_sampling(sampling), **fields)


@dataclass(frozen=True)
class SamplingSettings:
    """How each next token is chosen (the module docstring gives each field's rule)."""

    temp: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Mapping[int, float] | None = None
    seed: int | None = None

    def __post_init__(self) -> None:
        check_number("temp", self.temp, low=0.0)
        check_number("top_p", self.top_p, low=0.0, high=1.0, low_open=True)
        check_integer("top_k", self.top_k, low=0, high=MAX_INT32)
        check_number("min_p", self.min_p, low=0.0, high=1.0, high_open=True)
        if self.repetition_penalty is not None:
            check_number("repetition_penalty", self.repetition_penalty, low=0.0, low_open=True)
        check_number("presence_penalty", self.presence_penalty, low=-MAX_PENALTY, high=MAX_PENALTY)
        check_number("frequency_penalty", self.frequency_penalty, low=-MAX_PENALTY, high=MAX_PENALTY)
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, Mapping):
                raise OptionError("logit_bias", f"must map token ids to biases (got {self.logit_bias!r})")
            for token, bias in self.logit_bias.items():
                check_integer("logit_bias", token, low=0)
                check_number("logit_bias", bias, low=-MAX_LOGIT_BIAS, high=MAX_LOGIT_BIAS)
            object.__setattr__(self, "logit_bias", {int(t): float(b) for t, b in self.logit_bias.items()} or None)
        if self.seed is not None:
            check_integer("seed", self.seed, low=RANDOM_SEED, high=MAX_SEED)

    @property
    def greedy(self) -> bool:
        """Whether the next token is always the most likely one: at 0, and below ``GREEDY_BELOW``,
        where sampling's limit is the most likely token and float32 log-probabilities over the
        temperature would overflow (1e-40 drew end-of-text tokens)."""
        return self.temp < GREEDY_BELOW

    def check_vocabulary(self, vocab_size: int) -> None:
        """Refuse ``logit_bias`` ids outside a vocabulary of ``vocab_size`` tokens."""
        for token in self.logit_bias or {}:
            if token >= vocab_size:
                raise OptionError("logit_bias", f"token id {token} is outside the vocabulary (size {vocab_size})")

    def seeded(self) -> "SamplingSettings":
        """These settings with a concrete seed: the given one, or a random one for ``None``/``-1``."""
        if self.seed is not None and self.seed != RANDOM_SEED:
            return self
        return replace(self, seed=random.getrandbits(63))
