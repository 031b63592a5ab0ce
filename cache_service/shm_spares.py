"""Blank shared-memory segments made ahead of time, so a cold adapter's conversion never waits on page faults.

A fresh segment's pages are allocated (and zeroed) by the kernel on first
write: for a 57 MB SmolLM2 adapter the conversion's fill took 43-60 ms into a
fresh segment against 20 ms into one whose pages were allocated (2-core
machine), the largest single part of a cold named adapter's first request.
A background thread keeps up to two spare segments whose pages are already
allocated (zero-filled, as the converters need them) within
`--shm-spare-bytes`. It works only once no put has run for 0.25 s, a 4 MiB
chunk at a time, pausing while a put runs, at the lowest CPU priority:
allocating pages beside a running fill slowed both 3-5x, and right after a
put it slowed the compute service's fetch of the new adapter from 2 to 50-60
ms (2-core machine), so a spare is made in idle time or not at all.

A put takes the smallest spare at most 1/8 larger than itself and uses its
first bytes (the header says how many; cutting the file stalled concurrent
fills for 100+ ms); a put that no spare fits gets a fresh segment, as
before. Spares are sized for the largest recent put that the allowance
holds, or, before the first, for what the cache expects (HostCache: an
all-module adapter of rank 64). The default allowance, 256 MiB, leaves
adapters of the 8B shape (528 MB) without spares: on an H100 host their
spares slowed the resolve instead (docs/host_cache.md).

Spares carry the owner's instance tag, so `sweep_dead_owners` removes those
of a crashed service like any other segment; `close()` unlinks them.
"""
from __future__ import annotations

import logging
import mmap
import os
import threading
import time
from collections import deque
from typing import Callable

import numpy as np

from cache_service.shm_segments import HEADER_BYTES, OwnedSegment

log = logging.getLogger(__name__)

MAX_SPARES = 2
RECENT_PUTS = 8
_PAGE = mmap.PAGESIZE
SLACK = 8                   # a put takes a spare at most 1/8 larger than itself
MADV_POPULATE_WRITE = 23    # Linux >= 5.14: allocate a range's pages in one call, writable
POPULATE_CHUNK = 4 << 20    # a put that starts waits for at most one chunk of a spare being made
IDLE_S = 0.25               # spares are made once no put has run for this long (the compute service
                            # maps and uploads a new adapter right after its put: that goes first)


def populate(segment: OwnedSegment, may_go_on: Callable[[], bool] = lambda: True) -> bool:
    """Allocates the segment's pages (they read as zeros), a chunk at a time, asking `may_go_on` before
    each chunk; False when it said no (the rest is left for the puts' own faults)."""
    total = HEADER_BYTES + segment.num_bytes
    for start in range(0, total, POPULATE_CHUNK):
        if not may_go_on():
            return False
        length = min(POPULATE_CHUNK, total - start)
        try:
            segment.madvise(MADV_POPULATE_WRITE, start, length)
        except (OSError, ValueError):
            # Older kernels: fault each page in by writing its first byte (a zero, as it already is).
            data = segment.data
            try:
                lo = max(0, start - HEADER_BYTES)
                np.frombuffer(data, dtype=np.uint8)[lo:start + length - HEADER_BYTES:_PAGE] = 0
            finally:
                data.release()
    return True


def _fits(spare: OwnedSegment, num_bytes: int) -> bool:
    """A put of `num_bytes` may take `spare`: large enough, and at most 1/SLACK larger."""
    return num_bytes <= spare.num_bytes <= num_bytes + num_bytes // SLACK


class SpareSegments:
    """At most MAX_SPARES pre-populated segments in all, within `allowance_bytes`, made while no put is in
    flight."""

    def __init__(self, instance: str, allowance_bytes: int) -> None:
        self.instance = instance
        self.allowance_bytes = allowance_bytes
        self._cond = threading.Condition()
        self._spares: list[OwnedSegment] = []
        self._recent: deque[int] = deque(maxlen=RECENT_PUTS)
        self._expected = 0
        self._puts = 0              # puts in flight (taken a segment, not yet committed or aborted)
        self._last_put = 0.0        # monotonic time the last put finished
        self._making = False
        self._closed = False
        self._thread: threading.Thread | None = None
        self.taken = self.missed = 0

    # -- puts -----------------------------------------------------------------
    def expect(self, num_bytes: int) -> None:
        """The size puts are expected to have until some are seen; starts the refill thread."""
        with self._cond:
            self._expected = num_bytes
            self._start_locked()
            self._cond.notify_all()

    def take(self, num_bytes: int) -> OwnedSegment | None:
        """Starts a put: a populated, zero-filled segment holding `num_bytes` weight bytes, or None (make a
        fresh one). Every call is followed by one `put_finished()`."""
        with self._cond:
            self._puts += 1
            self._recent.append(num_bytes)
            fits = [s for s in self._spares if _fits(s, num_bytes)]
            spare = min(fits, key=lambda s: s.num_bytes) if fits else None
            if spare is not None:
                self._spares.remove(spare)
                self.taken += 1
            else:
                self.missed += 1
            self._start_locked()
        if spare is not None:
            spare.use_first(num_bytes)
        return spare

    def put_finished(self) -> None:
        """The put that `take` started was committed or aborted: spares may be made again."""
        with self._cond:
            self._puts -= 1
            self._last_put = time.monotonic()
            self._cond.notify_all()

    def spare_sizes(self) -> list[int]:
        with self._cond:
            return sorted(s.num_bytes for s in self._spares)

    def wait_ready(self, timeout_s: float) -> bool:
        """Waits until no spare is missing or being made (for tests and benchmarks)."""
        with self._cond:
            return self._cond.wait_for(lambda: self._closed or (self._wanted_locked() is None and not self._making),
                                       timeout_s)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            thread, spares, self._spares = self._thread, self._spares, []
        if thread is not None:
            thread.join()
        for s in spares:
            s.retire()

    # -- the refill thread ----------------------------------------------------
    def _target_locked(self) -> int:
        """The largest recent put that the allowance holds (before any put: the expected size); 0 = none."""
        fits = [n for n in self._recent if n <= self.allowance_bytes]
        if not self._recent:
            fits = [self._expected] if 0 < self._expected <= self.allowance_bytes else []
        return max(fits, default=0)

    def _plan_locked(self) -> tuple[int | None, list[OwnedSegment]]:
        """(size of the next spare to make, or None when none is missing or none fits; the spares of other
        sizes that must go first to make room, the smallest first). Changes nothing."""
        target = self._target_locked()
        if self._closed or target == 0:
            return None, []
        fitting = [s for s in self._spares if _fits(s, target)]
        if len(fitting) >= MAX_SPARES:
            return None, []
        held, count, victims = sum(s.num_bytes for s in self._spares), len(self._spares), []
        for other in sorted((s for s in self._spares if s not in fitting), key=lambda s: s.num_bytes):
            if held + target <= self.allowance_bytes and count < MAX_SPARES:
                break
            victims.append(other)
            held, count = held - other.num_bytes, count - 1
        if held + target <= self.allowance_bytes and count < MAX_SPARES:
            return target, victims
        return None, []

    def _wanted_locked(self) -> int | None:
        return self._plan_locked()[0]

    def _idle_remaining_locked(self) -> float:
        """Seconds until the cache counts as idle (0: idle now); inf while a put is in flight."""
        if self._puts:
            return float("inf")
        return max(0.0, self._last_put + IDLE_S - time.monotonic())

    def _wait_idle_locked(self, wanted: Callable[[], bool]) -> bool:
        """Waits (lock held) until closed, or idle with `wanted()` true; False when closed."""
        while not self._closed:
            left = self._idle_remaining_locked()
            if left == 0 and wanted():
                return True
            self._cond.wait(None if left == float("inf") or left == 0 else left)
        return False

    def _idle_or_closed(self) -> bool:
        """Waits until the cache is idle; False when closed meanwhile."""
        with self._cond:
            return self._wait_idle_locked(lambda: True)

    def _start_locked(self) -> None:
        if self._thread is None and not self._closed and self.allowance_bytes > 0:
            self._thread = threading.Thread(target=self._run, name="shm-spares", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        try:    # below the request threads: a spare never takes a core from a request
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except (OSError, AttributeError):
            pass
        while True:
            with self._cond:
                if not self._wait_idle_locked(lambda: self._wanted_locked() is not None):
                    return
                size, victims = self._plan_locked()
                if size is None:
                    continue
                for victim in victims:
                    self._spares.remove(victim)
                self._making = True
            for victim in victims:     # unmapping takes a while: not under the lock puts take spares with
                victim.retire()
            segment = None
            try:
                segment = OwnedSegment(self.instance, size)
                done = populate(segment, self._idle_or_closed)
            except Exception as exc:    # /dev/shm full: puts make their own segments, as without spares
                log.warning("could not make a %d-byte spare shared-memory segment: %s", size, exc)
                done = False
                with self._cond:
                    self._recent.clear()
                    self._expected = 0
            with self._cond:
                self._making = False
                keep = done and segment is not None and not self._closed
                if keep:
                    self._spares.append(segment)
                self._cond.notify_all()
            if segment is not None and not keep:
                segment.retire()
