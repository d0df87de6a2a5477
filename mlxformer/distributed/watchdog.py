"""A watchdog that ends the process when a wait for another rank lasts too long.

A rank that dies closes its sockets and the others' collectives fail at once, but a rank
that hangs, or a machine that drops off the network, leaves them waiting forever. Every
blocking wait runs under ``Watchdog.guard``: past the timeout, the process prints why and
exits with ``EXIT_CODE`` (the main thread may be blocked inside MLX, so this is done from
the watchdog's own thread).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from contextlib import contextmanager
from typing import Iterator, TypeVar

from mlxformer.errors import MlxformerError
from mlxformer.sampling.options import check_number

EXIT_CODE = 1
DEFAULT_TIMEOUT = 60.0
T = TypeVar("T")


def check_timeout(timeout: float) -> float:
    """The timeout if it is a positive, finite number of seconds, else ``OptionError``."""
    return check_number("timeout", timeout, low=0.0, low_open=True)


class Watchdog:
    """Ends this process if a guarded wait lasts longer than ``timeout`` seconds."""

    def __init__(self, rank: int, timeout: float = DEFAULT_TIMEOUT, poll: float = 0.25) -> None:
        self.rank, self.timeout, self._poll = rank, check_timeout(timeout), poll
        self._deadline: float | None = None
        self._what = ""
        self._armed = timeout
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._watch, name="mlxformer-watchdog", daemon=True)
        self._thread.start()

    def arm(self, what: str, timeout: float | None = None) -> None:
        """Start (or restart) the countdown for a wait described by ``what``."""
        with self._lock:
            self._armed = timeout or self.timeout
            self._deadline = time.monotonic() + self._armed
            self._what = what

    def disarm(self) -> None:
        """Stop the countdown."""
        with self._lock:
            self._deadline = None

    @contextmanager
    def guard(self, what: str, timeout: float | None = None) -> Iterator[None]:
        """Run the body under the countdown; a lost connection becomes a clear ``MlxformerError``."""
        self.arm(what, timeout)
        try:
            yield
        except RuntimeError as exc:
            raise MlxformerError(
                f"rank {self.rank}: {what} failed: {str(exc).strip() or type(exc).__name__} "
                "(another rank failed or disconnected)"
            ) from None
        finally:
            self.disarm()

    def each(self, items: Iterator[T], what: str, first: int = 1) -> Iterator[T]:
        """``items`` with the making of each one guarded (one countdown per step of a loop; the
        consumer's time between items is not counted); the first gets ``first`` timeouts."""
        timeout = self.timeout * first
        while True:
            with self.guard(what, timeout):
                item = next(items, None)
            if item is None:
                return
            yield item
            timeout = self.timeout

    def _watch(self) -> None:
        while True:
            time.sleep(self._poll)
            with self._lock:
                expired = self._deadline is not None and time.monotonic() > self._deadline
                what, armed = self._what, self._armed
            if expired:
                print(
                    f"mlxformer: error: rank {self.rank}: no progress for {armed:g} s while {what} "
                    "(another rank failed, hangs or disconnected); exiting",
                    file=sys.stderr, flush=True,
                )
                os._exit(EXIT_CODE)
