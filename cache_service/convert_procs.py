"""PEFT conversions in worker processes: the row fill and the hash run outside the service's GIL.

A cold named adapter's conversion is a few thousand short array operations
(its rows' copies, scales and finite checks) and a hash; in the service's own
process they take the GIL between operations, so a burst of new names (a
user's first requests) converted one adapter at a time however many cores the
host has, and stalled the event loop and the spare maker while it did.

With `--convert-processes N` (shm backend), the service still plans the
conversion from the file headers and opens the adapter's shared-memory
segment; a worker process then plans again from the same headers (checking
that the shapes did not change), maps the segment by name, writes and checks
every row, and hashes the version over the bytes it wrote. The service keeps
the structural checks and the commit. Workers are spawned (not forked: the
service runs gRPC threads) at start and import their modules before the first
adapter arrives. A worker that dies (killed, out of memory) fails no request:
the pool is made again and that adapter is converted in the service's process.
"""
from __future__ import annotations

import logging
import math
import mmap
import os
import pickle
import threading
import time
from concurrent.futures import CancelledError, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

import torch

from loraplex.errors import UnavailableError
from loraplex.formats import AdapterError
from loraplex.formats.errors import AdapterFormatError
from loraplex.formats.peft_rows import plan_peft
from loraplex.worker_pool import spawned_pool, start_workers
from cache_service.uploads import fill_rows_hashed

log = logging.getLogger(__name__)


class WorkersLost(RuntimeError):
    """The worker converting an adapter died; the caller converts it in its own process instead."""


def _portable(exc: AdapterError) -> AdapterError:
    """`exc` if it survives pickling back to the service (message and row kept), else the same message
    as a plain format error."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001 - an exception class whose constructor pickle cannot call
        return AdapterFormatError(str(exc))


def _map_segment(segment: str, size: int) -> mmap.mmap:
    import _posixshmem  # CPython's shm_open: attaching this way registers nothing with a resource tracker

    fd = _posixshmem.shm_open("/" + segment, os.O_RDWR, mode=0)
    try:
        if os.fstat(fd).st_size < size:
            raise AdapterFormatError(f"segment {segment} is smaller than the adapter's {size} bytes")
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


def fill_segment(folder: str, dtype: str, segment: str, offset: int, shape: tuple[int, int]) -> str:
    """In a worker: converts the PEFT folder's rows into `segment` at `offset` (zero-filled), checking
    every row for NaN/Inf, and returns the version of the bytes written."""
    try:
        rows = plan_peft(folder, dtype=dtype)
        if rows.shape != tuple(shape):
            raise AdapterFormatError(f"{folder} changed on disk while it was converted "
                                     f"(rows {list(rows.shape)}, planned {list(shape)})")
        mm = _map_segment(segment, offset + rows.num_bytes)
        try:
            weights = torch.frombuffer(mm, dtype=rows.dtype, count=math.prod(shape), offset=offset).view(*shape)
            data = memoryview(mm)[offset:offset + rows.num_bytes]
            try:
                return fill_rows_hashed(rows, weights, data)
            finally:
                del weights
                data.release()
        finally:
            mm.close()
    except AdapterError as exc:
        raise _portable(exc.with_traceback(None)) from None


class ConvertProcesses:
    """A pool of `processes` spawned workers for `fill_segment`; made again if a worker dies.
    `local_first`: a conversion that finds none running in the service's process runs there (a lone
    cold adapter pays no hand-over to a worker, nor the worker's second plan); only the conversions that
    arrive while one runs go to the workers (`disk_loads`)."""

    def __init__(self, processes: int, local_first: bool = True) -> None:
        if processes < 1:
            raise ValueError("processes must be >= 1")
        self.processes = processes
        self.local_first = local_first
        self._lock = threading.Lock()
        self._pool: ProcessPoolExecutor | None = None
        self._closed = False

    def _executor(self) -> ProcessPoolExecutor:
        with self._lock:
            if self._closed:
                raise UnavailableError("the cache service is stopping: its conversion workers are stopped")
            if self._pool is None:
                self._pool = spawned_pool(self.processes)
            return self._pool

    def start(self) -> None:
        """Spawns every worker and waits until each has imported its modules (a few seconds, once)."""
        t0 = time.monotonic()
        pool = self._executor()
        pids = {f.result() for f in start_workers(pool, self.processes)}
        log.info("conversion workers: %d processes ready in %.1f s (pids %s)", self.processes,
                 time.monotonic() - t0, ", ".join(map(str, sorted(pids))))

    def fill(self, folder: Path, dtype: torch.dtype, segment: str, offset: int, shape: tuple[int, int]) -> str:
        """`fill_segment` in a worker; AdapterError as the worker raised it, WorkersLost if it died."""
        pool = self._executor()
        dtype_name = str(dtype).removeprefix("torch.")
        try:
            return pool.submit(fill_segment, str(folder), dtype_name, segment, offset, tuple(shape)).result()
        except BrokenProcessPool as exc:
            with self._lock:
                if self._pool is pool:
                    self._pool = None
            pool.shutdown(wait=False, cancel_futures=True)
            log.error("a conversion worker died (%s); the pool is made again and %s is converted in the "
                      "service's process", exc, folder)
            raise WorkersLost(str(exc)) from exc
        except CancelledError:
            raise UnavailableError("the cache service is stopping: the conversion was cancelled") from None

    def close(self) -> None:
        with self._lock:
            self._closed = True
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
