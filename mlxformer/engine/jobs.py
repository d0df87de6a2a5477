"""Work other than generation that the engine's thread runs between steps: embedding and
rerank batches (forwards that keep no cache) share the model with the decode batch this way,
never running beside it."""

from __future__ import annotations

import threading
from collections import deque
from concurrent.futures import Future
from typing import Any, Callable

__all__ = ["Jobs"]


class Jobs:
    """A queue of callables, each with the ``Future`` of its result."""

    def __init__(self) -> None:
        self._queue: deque[tuple[Callable[[], Any], Future]] = deque()
        self._lock = threading.Lock()

    def __bool__(self) -> bool:
        return bool(self._queue)

    def add(self, work: Callable[[], Any]) -> Future:
        """Queue ``work``; its ``Future`` gets its result or its exception."""
        future: Future = Future()
        with self._lock:
            self._queue.append((work, future))
        return future

    def run_all(self) -> None:
        """Run the queued jobs in order (on the calling thread: the engine's)."""
        while True:
            with self._lock:
                if not self._queue:
                    return
                work, future = self._queue.popleft()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(work())
            except BaseException as exc:  # handed to the waiter, never raised in the engine's loop
                future.set_exception(exc)

    def fail_all(self, error: BaseException) -> None:
        """End every queued job with ``error`` (the engine stops or its thread died)."""
        with self._lock:
            queued, self._queue = list(self._queue), deque()
        for _, future in queued:
            if future.set_running_or_notify_cancel():
                future.set_exception(error)
