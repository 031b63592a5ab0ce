"""Rank 0 -> followers, on one host: each step's message through a shared-memory slot.

A pickled broadcast over the gloo control group cost rank 0 about 1.4 ms per decode step at TP=2
(two socket round trips on the critical path, before the followers could start). Here rank 0
writes the pickled message into a memory-mapped file every rank maps, then bumps a sequence
number; a follower polls the number (spinning briefly on GPUs, where a step lasts milliseconds;
sleeping on CPUs, where it would steal the cores the forward needs) and acknowledges what it read.
Messages larger than the slot (adapters shipped on first use) go over the control group instead,
announced in the slot.

Liveness: every rank writes its pid; a waiting rank checks its peers' pids, so a dead rank 0 or
a dead follower ends the wait with an error instead of a hang. The file is unlinked as soon as
every rank has mapped it, so nothing is left behind in /dev/shm, whatever way the group ends.
Memory order: rank 0 stores the payload before the sequence number; x86-64 keeps stores in order.
"""
from __future__ import annotations

import mmap
import os
import pickle
import time
import uuid
from typing import Any, Callable

import numpy as np

HEADER = 4096                   # bytes before the payload
MAX_RANKS = 64
BIG = np.iinfo(np.uint64).max   # size word: the payload travels over the control group
# word offsets in the header
_SEQ, _SIZE, _ACKS, _PIDS = 0, 1, 8, 8 + MAX_RANKS
SPIN_ITERATIONS = 20000         # polls before the first sleep (GPU ranks)


class StepChannel:
    """One writer (rank 0), `world - 1` readers; `send` / `receive` move one object each."""

    def __init__(self, path: str, rank: int, world: int, capacity: int, *, spin: bool,
                 fallback_send: Callable[[Any], None], fallback_receive: Callable[[], Any]) -> None:
        if world > MAX_RANKS:
            raise ValueError(f"step channel: at most {MAX_RANKS} ranks, got {world}")
        self.rank, self.world, self.capacity, self.spin = rank, world, capacity, spin
        fd = os.open(path, os.O_RDWR)
        try:
            self._mm = mmap.mmap(fd, HEADER + capacity)
        finally:
            os.close(fd)
        self._words = np.frombuffer(self._mm, dtype=np.uint64, count=HEADER // 8)
        self._words[_PIDS + rank] = os.getpid()
        self._seq = int(self._words[_SEQ])
        self._fallback_send, self._fallback_receive = fallback_send, fallback_receive

    @staticmethod
    def create(capacity: int, folder: str = "/dev/shm") -> str:
        """Rank 0: a zeroed file of the channel's size; returns its path (send it to the followers)."""
        folder = folder if os.path.isdir(folder) else "/tmp"
        path = os.path.join(folder, f"loraplex-tp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, HEADER + capacity)
        finally:
            os.close(fd)
        return path

    # -- rank 0 -------------------------------------------------------------------------------------
    def send(self, obj: Any, timeout_s: float) -> None:
        """Publishes `obj` once every follower has read the previous message."""
        self._wait(lambda: all(int(self._words[_ACKS + r]) >= self._seq for r in range(1, self.world)),
                   "followers to read the previous step", timeout_s, range(1, self.world))
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        big = len(data) > self.capacity
        if not big:
            self._mm[HEADER:HEADER + len(data)] = data
        self._words[_SIZE] = BIG if big else len(data)
        self._seq += 1
        self._words[_SEQ] = self._seq                # last: a reader that sees it sees the payload
        if big:
            self._fallback_send(obj)

    # -- followers ----------------------------------------------------------------------------------
    def receive(self, timeout_s: float) -> Any:
        """The next message from rank 0 (waits up to `timeout_s`; fails at once if rank 0 is gone)."""
        want = self._seq + 1
        self._wait(lambda: int(self._words[_SEQ]) >= want, "a step from rank 0", timeout_s, (0,))
        self._seq = want
        size = self._words[_SIZE]
        if size == BIG:
            self._words[_ACKS + self.rank] = want
            return self._fallback_receive()
        obj = pickle.loads(self._mm[HEADER:HEADER + int(size)])
        self._words[_ACKS + self.rank] = want
        return obj

    def close(self) -> None:
        del self._words
        self._mm.close()

    # -- waiting ------------------------------------------------------------------------------------
    def _wait(self, done: Callable[[], bool], what: str, timeout_s: float, peers: Any) -> None:
        polls = 0
        start = time.monotonic()
        spin = SPIN_ITERATIONS if self.spin else 0
        while not done():
            polls += 1
            if polls <= spin:
                continue
            waited = time.monotonic() - start
            if polls % 64 == 0:
                self._check_peers(peers, what)
                if waited > timeout_s:
                    raise RuntimeError(f"tensor parallel rank {self.rank}: waited {waited:.0f} s for {what}")
            time.sleep(0 if waited < 0.002 else 50e-6 if waited < 1.0 else 1e-3)

    def _check_peers(self, peers: Any, what: str) -> None:
        for r in peers:
            pid = int(self._words[_PIDS + r])
            if pid and not _alive(pid):
                raise RuntimeError(f"tensor parallel rank {self.rank}: rank {r} (pid {pid}) is gone while "
                                   f"waiting for {what}")


def _alive(pid: int) -> bool:
    """The process exists and is not a zombie (a dead child not yet reaped still answers kill 0)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
        return state not in (b"Z", b"X")
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
            return True
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
