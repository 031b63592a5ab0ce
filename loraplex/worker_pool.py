"""Worker processes beside a service, for CPU-heavy work outside its GIL (adapter conversions, kernel compiles).

Spawned, not forked: the services run threads (gRPC, the engine), and a fork would copy their locks mid-use.
Each worker ignores SIGINT (Ctrl-C reaches the whole process group; the service stops its workers itself),
runs torch on one thread (several workers share the cores), then runs its pool's own `setup`.
"""
from __future__ import annotations

import multiprocessing
import os
import signal
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor


def _init(setup: Callable[[], None] | None) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import torch

    torch.set_num_threads(1)
    if setup is not None:
        setup()


def worker_pid() -> int:
    return os.getpid()


def spawned_pool(processes: int, setup: Callable[[], None] | None = None) -> ProcessPoolExecutor:
    """A pool of `processes` spawned workers; `setup` (a module-level function) runs in each at its start."""
    return ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("spawn"), initializer=_init,
                               initargs=(setup,))


def start_workers(pool: ProcessPoolExecutor, processes: int) -> list[Future[int]]:
    """One small task per worker, so that all `processes` are spawned now rather than on demand; each
    future gives a worker's pid once it has started (and run its setup)."""
    return [pool.submit(worker_pid) for _ in range(processes)]
