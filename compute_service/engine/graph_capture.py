"""One way to capture a CUDA graph: a warm run on a side stream, then a thread-local capture."""
from __future__ import annotations

from typing import Callable, TypeVar

import torch

R = TypeVar("R")


def capture(fn: Callable[[], R], pool: tuple[int, int] | None) -> tuple[torch.cuda.CUDAGraph, R]:
    """(graph of `fn`, what the captured call returned). `fn` runs once eagerly first, on a side stream:
    that compiles Triton kernels and settles lazy allocations outside the capture. The capture is
    thread-local: other threads' CUDA calls (adapter uploads) neither break it nor get refused while it
    runs, as they would in the default global mode."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        out = fn()
    return graph, out
