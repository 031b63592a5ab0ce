"""Adapters reach the followers when rank 0 stages them, not on the step that first uses them.

Rank 0 stages an adapter on a loader thread (fetch, check, upload) and only then schedules requests
for it. Before, the followers were sent the whole adapter inside that first step's message (pickled
over the control group) and staged it synchronously, so every rank waited for the slowest copy of
the load: a cold adapter stalled the batch on a TP group. Now rank 0's loader thread writes the
pickled adapter to a shared-memory file, one hard link per follower, and sends a "prefetch" message
naming it; each follower opens its link at once and stages its share on a thread of its own
(`Prefetcher`), while the batch runs. The step that first uses the adapter only names it, and the
follower installs what it staged (waiting only if its staging is not done yet).

A follower unlinks its link after reading it; rank 0 removes whatever is left when the group ends.
"""
from __future__ import annotations

import glob
import logging
import os
import pickle
import uuid
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, BinaryIO

from loraplex.formats.adapter import Adapter

log = logging.getLogger(__name__)
MAX_PENDING = 16     # staged adapters a follower keeps for steps to come (rank 0 stages far fewer at once)


def _folder() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else "/tmp"


class AdapterMailer:
    """Rank 0: writes an adapter once, links it for each follower; returns the base path to send."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.prefix = os.path.join(_folder(), f"loraplex-tp-adapters-{os.getpid()}-{uuid.uuid4().hex[:8]}")

    def write(self, adapter: Adapter) -> str:
        base = f"{self.prefix}-{uuid.uuid4().hex[:12]}"
        with open(base, "wb") as f:
            pickle.dump(adapter, f, protocol=pickle.HIGHEST_PROTOCOL)
        try:
            for r in range(1, self.world):
                os.link(base, follower_path(base, r))
        finally:
            os.unlink(base)
        return base

    def close(self) -> None:
        """Removes the links no follower read (a follower that died, adapters never used)."""
        for path in glob.glob(self.prefix + "*"):
            try:
                os.unlink(path)
            except OSError:
                pass


def follower_path(base: str, rank: int) -> str:
    return f"{base}.r{rank}"


class Prefetcher:
    """A follower: stages announced adapters on its own thread; `take` hands one to the step using it."""

    def __init__(self, slots: Any, rank: int) -> None:
        self._slots = slots
        self._rank = rank
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"loraplex-tp{rank}-prefetch")
        self._pending: OrderedDict[str, Future[Any]] = OrderedDict()

    def announce(self, key: str, base: str) -> None:
        """Opens this rank's link now (rank 0 may move on) and stages the adapter in the background."""
        path = follower_path(base, self._rank)
        f = open(path, "rb")
        os.unlink(path)                         # the open file keeps the bytes
        self._pending.pop(key, None)            # a newer version of the same key replaces the older
        self._pending[key] = self._pool.submit(self._stage, key, f)
        while len(self._pending) > MAX_PENDING:
            old, _ = self._pending.popitem(last=False)
            log.warning("tensor parallel rank %d: dropped the staged adapter %s (never used)", self._rank, old)

    def _stage(self, key: str, f: BinaryIO) -> Any:
        with f:
            adapter = pickle.load(f)
        return self._slots.stage_adapter(key, adapter)

    def take(self, key: str) -> Any:
        """What was staged for `key` (waits for its staging); KeyError when it was never announced."""
        return self._pending.pop(key).result()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
