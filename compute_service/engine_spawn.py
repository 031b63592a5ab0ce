"""Starting the engine process before the gRPC side imports anything heavy.

`loraplex compute` with the engine in a child process (`--engine-process`)
spawns that child first: the child imports torch and loads the model while
this process imports its own modules, instead of after them (about 2 s of
start-up on an H200 host). So this module imports nothing heavy, and asks
the CUDA driver directly whether a GPU is visible (what `--device auto`
resolves to) rather than through torch.
"""
from __future__ import annotations

import ctypes
import multiprocessing
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any


def cuda_visible(device: str) -> bool:
    """Whether the engine would run on a GPU for `--device` (auto: the driver sees one)."""
    if device != "auto":
        return device.startswith("cuda")
    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    count = ctypes.c_int(0)
    return driver.cuInit(0) == 0 and driver.cuDeviceGetCount(ctypes.byref(count)) == 0 and count.value > 0


def spawn_engine(config: Any) -> tuple[BaseProcess, Connection]:
    """Spawns the engine process (`compute_service.engine_process`); returns it and this side's pipe end."""
    ctx = multiprocessing.get_context("spawn")
    ours, theirs = ctx.Pipe(duplex=True)
    proc = ctx.Process(target=_engine_entry, args=(config, theirs), name="loraplex-engine")
    proc.start()
    theirs.close()
    return proc, ours


def _engine_entry(config: Any, conn: Connection) -> None:
    from compute_service.engine_process import engine_main

    engine_main(config, conn)
