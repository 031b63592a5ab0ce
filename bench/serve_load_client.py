"""Load-generator processes of bench/serve_load.py: streams through the public `AsyncClient`.

`ClientPool(address, n)` starts `n` processes (spawned, so none inherits the
parent's torch); each keeps one `AsyncClient` and one event loop for the whole
run. `pool.run(requests, start_at, max_in_flight, sampling)` hands each process
its share of the requests (round-robin), every process waits for the common
start time (`time.monotonic()`, one clock for all processes of the machine),
sends each request at `start_at + arrival`, at most its share of
`max_in_flight` at once, and records when each message arrived and how many
tokens it carried. The timelines come back merged, in request order.
"""
from __future__ import annotations

import asyncio
import multiprocessing as mp
import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Request:
    """One request of a case: its prompt, adapter name (None = base) and arrival offset (s)."""

    index: int
    prompt: list[int]
    lora: str | None
    arrival_s: float


@dataclass
class Timeline:
    """What one request saw: when it was sent, and (time, tokens) per message that carried tokens."""

    index: int
    arrival: float
    sent: float
    messages: list[tuple[float, int]] = field(default_factory=list)
    finish_reason: str | None = None
    error: str = ""

    @property
    def num_tokens(self) -> int:
        return sum(k for _, k in self.messages)


async def _one(client: Any, req: Request, start_at: float, sem: asyncio.Semaphore, sampling: dict) -> Timeline:
    delay = start_at + req.arrival_s - time.monotonic()
    if delay > 0:
        await asyncio.sleep(delay)
    async with sem:
        tl = Timeline(req.index, start_at + req.arrival_s, time.monotonic())
        try:
            async for chunk in client.stream(req.prompt, req.lora, **sampling):
                if chunk.token_ids:
                    tl.messages.append((time.monotonic(), len(chunk.token_ids)))
                if chunk.finish_reason is not None:
                    tl.finish_reason, tl.error = chunk.finish_reason, chunk.error
        except Exception as exc:  # a failed request is a result, not the end of the run
            tl.finish_reason, tl.error = "error", f"{type(exc).__name__}: {exc}"
        return tl


async def _run(client: Any, job: dict) -> list[Timeline]:
    sem = asyncio.Semaphore(job["max_in_flight"])
    return list(await asyncio.gather(*[_one(client, r, job["start_at"], sem, job["sampling"])
                                       for r in job["requests"]]))


def _worker(conn: Any, address: str, connections: int = 1) -> None:
    from loraplex.client import AsyncClient

    loop = asyncio.new_event_loop()

    async def open_client() -> AsyncClient:
        return AsyncClient(address, connections=connections)

    client = loop.run_until_complete(open_client())
    conn.send("ready")
    while (job := conn.recv()) is not None:
        conn.send(loop.run_until_complete(_run(client, job)))
    loop.run_until_complete(client.close())
    conn.close()


class ClientPool:
    """`num_procs` load-generator processes talking to the gateway at `address`."""

    def __init__(self, address: str, num_procs: int, connections: int = 1) -> None:
        ctx = mp.get_context("spawn")
        self._conns, self._procs = [], []
        for _ in range(num_procs):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker, args=(child, address, connections), daemon=True)
            proc.start()
            self._conns.append(parent)
            self._procs.append(proc)
        for c in self._conns:
            if c.recv() != "ready":
                raise RuntimeError("a load-generator process did not start")

    def run(self, requests: list[Request], max_in_flight: int, sampling: dict,
            lead_s: float = 0.5) -> list[Timeline]:
        """Runs one case; `max_in_flight` is split over the processes that get requests."""
        used = min(len(self._conns), len(requests), max_in_flight)
        start_at = time.monotonic() + lead_s
        for i in range(used):
            share = max_in_flight // used + (1 if i < max_in_flight % used else 0)
            self._conns[i].send(dict(requests=requests[i::used], start_at=start_at, max_in_flight=share,
                                     sampling=sampling))
        out = [tl for c in self._conns[:used] for tl in c.recv()]
        return sorted(out, key=lambda t: t.index)

    def close(self) -> None:
        for c, p in zip(self._conns, self._procs):
            try:
                c.send(None)
            except OSError:
                pass
            p.join(10)
            if p.is_alive():
                p.terminate()
