"""Sampled tokens to the host without waiting on later GPU work.

`tokens.tolist()` on a CUDA tensor copies in stream order at the time it is called: with overlapped
steps (`EngineConfig.async_scheduling`) the previous step's tokens are read after the next step has
been queued, so that read waited for the next step as well and the GPU idled until the host queued
another one. Here the copy into pinned host memory is queued right after sampling, with an event,
and reading waits for that event alone.
"""
from __future__ import annotations

import torch

RING = 3        # pinned buffers in turn: a step's tokens are read before the step two later is sampled


class TokenReadback:
    """Queues each step's token copy to the host as soon as it is sampled; `read` returns them."""

    def __init__(self, max_tokens: int, device: torch.device) -> None:
        self.device = torch.device(device)
        self.max_tokens = max_tokens
        self._bufs: list[torch.Tensor] = []     # none on the CPU: the sampled tokens are host memory already
        if self.device.type == "cuda":
            self._bufs = [torch.empty(max_tokens, dtype=torch.int64, pin_memory=True) for _ in range(RING)]
        self._next = 0

    def start(self, tokens: torch.Tensor) -> "PendingRead":
        """tokens [N] int64 on the device: their copy to the host, queued now on the current stream."""
        n = tokens.shape[0]
        if n > self.max_tokens:
            raise ValueError(f"{n} tokens exceed the read-back buffers' {self.max_tokens}")
        if not self._bufs:
            return PendingRead(tokens, None)
        host = self._bufs[self._next][:n]
        self._next = (self._next + 1) % RING
        host.copy_(tokens, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return PendingRead(host, done)


class PendingRead:
    """One step's tokens on their way to the host."""

    __slots__ = ("_host", "_done")

    def __init__(self, host: torch.Tensor, done: "torch.cuda.Event | None") -> None:
        self._host = host
        self._done = done

    def read(self) -> list[int]:
        """Waits for this copy alone (not for GPU work queued after it) and returns the tokens."""
        if self._done is not None:
            self._done.synchronize()
        return self._host.tolist()
