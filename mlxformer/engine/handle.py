"""A submitted request as its caller sees it: iterate it (or ``async for`` over ``aiter()``) for
its ``TokenEvent``s, ``cancel()`` it. The engine's thread puts events and errors in; the
handle also keeps the request's times for the latency metrics."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from typing import AsyncIterator, Callable, Iterator

from mlxformer.engine.request_state import RequestState, TokenEvent


class RequestHandle:
    """A submitted request: iterate it (``for event in handle``, or ``async for`` over
    ``handle.aiter()``) to get its ``TokenEvent``s; ``cancel()`` ends it and frees its slot."""

    def __init__(self, sequence: RequestState, notify: Callable[[], None]) -> None:
        self._notify = notify
        self.sequence = sequence
        self._events: deque[TokenEvent] = deque()
        self._error: BaseException | None = None
        self._cond = threading.Condition()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []
        self.submitted_at = time.monotonic()
        self.last_event_at: float | None = None  # when the engine put the latest event

    @property
    def max_tokens(self) -> int:
        """The most tokens this request generates: its ``max_tokens``, or a default one
        (``fit_budget``) cut to what the KV budget holds for it (known at submit)."""
        return self.sequence.request.max_tokens

    # called on the engine thread
    def _put(self, event: TokenEvent | None = None, error: BaseException | None = None) -> None:
        with self._cond:
            if event is not None:
                self._events.append(event)
            if error is not None:
                self._error = error
            self._cond.notify_all()
            waiters = list(self._waiters)
        for loop, ready in waiters:
            try:
                loop.call_soon_threadsafe(ready.set)
            except RuntimeError:  # the loop was closed
                pass

    def _pop(self) -> TokenEvent | None:
        """The next event if any; raises the engine's error once the events are drained."""
        if self._events:
            return self._events.popleft()
        if self._error is not None:
            raise self._error
        return None

    def __iter__(self) -> Iterator[TokenEvent]:
        while True:
            with self._cond:
                while (event := self._pop()) is None:
                    self._cond.wait()
            yield event
            if event.finish_reason is not None:
                return

    async def aiter(self) -> AsyncIterator[TokenEvent]:
        """The events as an async iterator (woken by the engine thread, no polling)."""
        ready = asyncio.Event()
        waiter = (asyncio.get_running_loop(), ready)
        with self._cond:
            self._waiters.append(waiter)
        try:
            while True:
                ready.clear()
                with self._cond:
                    event = self._pop()
                if event is None:
                    await ready.wait()
                    continue
                yield event
                if event.finish_reason is not None:
                    return
        finally:
            with self._cond:
                self._waiters.remove(waiter)

    def cancel(self) -> None:
        """Stop generating: the slot is freed before the engine's next step and the last event
        has ``finish_reason == "cancelled"`` (unless the request had already finished)."""
        self.sequence.cancelled = True
        self._notify()
