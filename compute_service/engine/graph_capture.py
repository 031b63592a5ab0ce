"""One way to capture a CUDA graph: a warm run on a side stream, then a thread-local capture.

Both runs are graph forwards (`in_graph_forward`): the model takes the paths it takes in a graph (the LoRA
of 2-64 tokens beside the base projection, its delta added by the next kernel) in the warm run as well, so
every Triton program the capture launches was compiled before it. The warm-up's decode forwards run as
graph forwards too (`graph_forward`), so that they compile those programs with the others.
"""
from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Callable, TypeVar

import torch

R = TypeVar("R")
_state = threading.local()


def in_graph_forward() -> bool:
    """Whether this thread runs a forward that is captured into a CUDA graph, or stands for one."""
    return getattr(_state, "on", False) or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


@contextmanager
def graph_forward() -> Iterator[None]:
    """This thread's forwards inside it take a captured graph's paths (see the module's note)."""
    before = getattr(_state, "on", False)
    _state.on = True
    try:
        yield
    finally:
        _state.on = before


def capture(fn: Callable[[], R], pool: tuple[int, int] | None) -> tuple[torch.cuda.CUDAGraph, R]:
    """(graph of `fn`, what the captured call returned). `fn` runs once eagerly first, on a side stream:
    that compiles Triton kernels and settles lazy allocations outside the capture. The capture is
    thread-local: other threads' CUDA calls (adapter uploads) neither break it nor get refused while it
    runs, as they would in the default global mode."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), graph_forward():
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"), graph_forward():
        out = fn()
    return graph, out
