"""One run per key among concurrent callers: the first runs it, the others wait for its outcome.

A burst of requests naming an adapter nobody has loaded yet would otherwise
convert it once per request, in parallel: N times the CPU, N segments of its
size, and every request slower than one load. Waiters get the same result (or
the same exception) as the caller that ran it.
"""
from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Callable, Hashable, TypeVar

T = TypeVar("T")


class SingleFlight:
    """Thread-safe: `run(key, fn)` runs `fn` unless a run for `key` is in flight, then shares it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._calls: dict[Hashable, Future] = {}

    def run(self, key: Hashable, fn: Callable[[], T]) -> T:
        with self._lock:
            call = self._calls.get(key)
            owner = call is None
            if call is None:
                call = self._calls[key] = Future()
        if not owner:
            return call.result()
        try:
            result = fn()
        except BaseException as exc:
            call.set_exception(exc)
            raise
        else:
            call.set_result(result)
            return result
        finally:
            with self._lock:
                del self._calls[key]
