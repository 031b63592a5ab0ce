"""The event-loop side of the compute service: requests in, each step's deltas out to their consumers.

The engine and the adapter slots belong to the engine thread
(`compute_service.step_loop`); this side only sends it commands and reads its
step batches. A request is registered with a *consumer* (a StreamTokens
session, or a per-request queue for GenerateTokens) and a handle; the drain of
each batch hands every delta to its consumer, then tells each consumer once
that the batch ended, so a session builds one message per step, not one per
sequence.

A request naming an adapter the pool does not know comes back from the engine
thread as `NeedsFetch`: this side fetches it from the host cache and stages it
(in a worker thread; one fetch per adapter however many requests wait), then
resubmits the request with the staged rows. Cancelling, a passed deadline or a
broken session aborts the request on the engine thread before its next step:
KV blocks and the adapter pin are released there.
"""
from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from compute_service.adapter_cache.loader import Fetch, adapter_key, task_of
from compute_service.adapter_cache.paged_slots import PagedAdapterSlots
from compute_service.adapter_cache.staging import Uploaded
from compute_service.engine.errors import InvalidRequestError
from compute_service.engine.llm_engine import LLMEngine
from compute_service.engine.outputs import RequestOutput
from compute_service.engine.sampling_params import SamplingParams
from compute_service.request_errors import DeadlineExceededError
from compute_service.step_loop import Admission, NeedsFetch, StepLoop

# Staging is CPU work partly under the GIL: two workers keep a burst of loads moving.
STAGING_WORKERS = 2


class SequenceObserver(Protocol):
    """Sees every delta on the event loop with the drain's clock reading (`_Request.started` and
    `last_token_at` are its to read and set)."""

    def delivered(self, req: Any, out: RequestOutput, now: float) -> None:
        """New tokens (and perhaps the end) of one request."""

    def steady(self, seconds: float, n: int) -> None:
        """`n` requests each got one token `seconds` after their previous one (set `last_token_at`
        is then the caller's job): the common case of a decode step, observed once."""


class StepConsumer(Protocol):
    """Receives the deltas of the requests it registered (on the event loop).

    A consumer with a true `columnar` attribute also takes a step's unfinished deltas as columns,
    grouped by the engine thread (`deliver_columns`), so the event loop makes no Python call per
    sequence for them; a request's last delta still comes through `deliver`. Such a consumer may get
    the deltas of a step that ran before a `cancel` (or a deadline's `fail`) took effect on the
    engine: the handle of a request it already ended can still appear in its columns, and it drops
    them. A handle never appears in columns after its finished `deliver`."""

    def deliver(self, handle: int, out: RequestOutput) -> None:
        """New tokens of one request; `out.finished` on its last."""

    def fail(self, handle: int, exc: BaseException) -> None:
        """The request failed; nothing more comes for it."""

    def end_batch(self) -> None:
        """Every delta of the current step batch was delivered."""


@dataclass
class _Request:
    consumer: StepConsumer
    handle: int
    adm: Admission
    task_id: int | None
    version: str
    timer: asyncio.TimerHandle | None = None
    started: float = 0.0            # perf_counter when it started (latency metrics)
    last_token_at: float = 0.0      # perf_counter of its latest tokens; 0 before the first (engine thread)
    columnar: bool = False          # its consumer takes unfinished deltas as columns


class _QueueConsumer:
    """One request's deltas in an asyncio queue (GenerateTokens and in-process callers)."""

    columnar = False

    def __init__(self) -> None:
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

    def deliver(self, handle: int, out: RequestOutput) -> None:
        self.queue.put_nowait(out)

    def fail(self, handle: int, exc: BaseException) -> None:
        self.queue.put_nowait(exc)

    def end_batch(self) -> None:
        pass


class RequestRunner(Protocol):
    """Starts and cancels requests (`EngineRunner` here, `engine_link.RemoteRunner` for an engine process)."""

    def start_request(self, request_id: str, prompt: Sequence[int], params: SamplingParams,
                      task_id: int | None, version: str, consumer: StepConsumer, handle: int,
                      timeout_s: float | None = None) -> None: ...

    def cancel(self, request_id: str) -> None: ...


async def generate_with(runner: RequestRunner, request_id: str, prompt: Sequence[int], params: SamplingParams,
                        task_id: int | None = None, version: str = "") -> AsyncIterator[RequestOutput]:
    """One request's deltas through `runner`; the last one has `finished` set. Cancelling aborts it."""
    consumer = _QueueConsumer()
    runner.start_request(request_id, prompt, params, task_id, version, consumer, 0)
    done = False
    try:
        while True:
            item = await consumer.queue.get()
            if isinstance(item, BaseException):
                done = True
                raise item
            done = item.finished
            yield item
            if done:
                return
    finally:
        if not done:
            runner.cancel(request_id)


class EngineRunner:
    """Owns the engine thread; every method is called on the event loop."""

    def __init__(self, engine: LLMEngine, slots: PagedAdapterSlots, fetch: Fetch,
                 on_step: Callable[[int, float], None] | None = None, *, handoff: str = "launch",
                 trace_path: str = "") -> None:
        self.engine = engine
        self.slots = slots
        self.fetch = fetch              # reads adapters from the host cache
        self.on_step = on_step          # (num tokens emitted, step seconds), for metrics and benchmarks
        self.on_adapter_load: Callable[[int, float, bool], None] | None = None   # (bytes, seconds, ok)
        self.steps = StepLoop(engine, slots, self._drain, trace=bool(trace_path),
                              handoff=handoff)
        self.trace_path = trace_path    # where `stop` writes the step trace (`write_trace`)
        self._requests: dict[str, _Request] = {}
        self._fetches: dict[str, asyncio.Task[Uploaded]] = {}
        self._staging = ThreadPoolExecutor(STAGING_WORKERS, thread_name_prefix="adapter-staging")

    @property
    def num_steps(self) -> int:
        return self.steps.num_steps

    @property
    def latency(self) -> SequenceObserver | None:
        """Per-sequence timings (compute_service.metrics), observed on the engine thread as it routes."""
        return self.steps.latency

    @latency.setter
    def latency(self, observer: SequenceObserver | None) -> None:
        self.steps.latency = observer

    # -- lifecycle -----------------------------------------------------------------
    def start(self, switch_interval_s: float = 0.0) -> None:
        """Starts the engine thread; `switch_interval_s` > 0 sets Python's thread switch interval.

        The engine thread gives up the GIL at every kernel launch; with Python's default 5 ms
        interval another thread that got it (the event loop, an adapter upload) can keep it that
        long, many times per step.
        """
        if switch_interval_s > 0:
            sys.setswitchinterval(switch_interval_s)
        if not self.steps.running:
            self.steps.start(asyncio.get_running_loop())

    async def stop(self) -> None:
        await asyncio.to_thread(self.steps.stop)
        self._drain()
        if self.trace_path and self.steps.trace is not None:
            write_trace(self.trace_path, self.steps.trace)

    # -- requests ------------------------------------------------------------------------
    def start_request(self, request_id: str, prompt: Sequence[int], params: SamplingParams,
                      task_id: int | None, version: str, consumer: StepConsumer, handle: int,
                      timeout_s: float | None = None, columnar: bool | None = None) -> None:
        """Starts a request whose deltas go to `consumer.deliver(handle, ...)` (and, for a columnar
        consumer, `deliver_columns`; `columnar` overrides the consumer's own flag); raises on a
        duplicate id."""
        if self.steps.failure is not None:
            raise self.steps.failure
        if request_id in self._requests:
            raise InvalidRequestError(f"request id {request_id!r} is already running; use a new id")
        key = None if task_id is None else adapter_key(task_id, version)
        adm = Admission(request_id, list(prompt), params, key)
        req = _Request(consumer, handle, adm, task_id, version, started=time.perf_counter(),
                       columnar=getattr(consumer, "columnar", False) if columnar is None else columnar)
        adm.route = req
        if timeout_s is not None and timeout_s > 0:
            req.timer = asyncio.get_running_loop().call_later(timeout_s, self._expire, request_id)
        self._requests[request_id] = req
        self.steps.submit(lambda: self.steps.add(adm))

    def cancel(self, request_id: str) -> None:
        """Aborts a request (its consumer hears nothing more); unknown or finished ids are ignored."""
        req = self._requests.pop(request_id, None)
        if req is None:
            return
        if req.timer is not None:
            req.timer.cancel()
        if self.steps.failure is None:
            self.steps.submit(lambda: self.steps.abort(request_id))

    def generate(self, request_id: str, prompt: Sequence[int], params: SamplingParams,
                 task_id: int | None = None, version: str = "") -> AsyncIterator[RequestOutput]:
        """Streams one request's deltas; the last one has `finished` set. Cancelling aborts it."""
        return generate_with(self, request_id, prompt, params, task_id, version)

    def prefetch(self, task_id: int, version: str) -> asyncio.Future[bool]:
        """Starts loading an adapter with no request behind it; resolves to whether it was resident already."""
        return asyncio.ensure_future(self._prefetch(task_id, version))

    async def _prefetch(self, task_id: int, version: str) -> bool:
        key = adapter_key(task_id, version)
        resident = await self.on_engine(lambda: self._queue_prefetch(key, None))
        if resident is None:   # not in the pool: fetch and stage it, then queue its copy
            staged = await asyncio.shield(self._fetch(key, task_id, version))
            resident = await self.on_engine(lambda: self._queue_prefetch(key, staged))
        return bool(resident)

    def _queue_prefetch(self, key: str, staged: Uploaded | None) -> bool | None:
        """(engine thread) Queues the adapter's copy; None when it must be fetched first."""
        if not self.slots.offer(key, staged):
            return None
        resident = self.slots.is_ready(key)
        self.slots.prefetch(key)
        return resident

    def drop(self, task_id: int) -> asyncio.Future[bool]:
        """Drops every version of `task_id` from the GPU cache once unused."""
        def apply() -> bool:
            res = self.slots.residency
            assert res is not None
            keys = [e.key for e in res.entries() if task_of(e.key) == task_id]
            return any([res.drop(k) for k in keys])
        return self.on_engine(apply)

    def snapshot(self) -> asyncio.Future[tuple[Any, Any]]:
        """(engine stats, pool stats), read on the engine thread between two steps."""
        return self.on_engine(lambda: (self.engine.stats(), self.slots.stats()))

    def on_engine(self, fn: Callable[[], Any]) -> asyncio.Future[Any]:
        """Runs `fn` on the engine thread between two steps (at once when it is not running)."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[Any] = loop.create_future()

        def apply() -> None:
            try:
                result = fn()
            except Exception as exc:  # noqa: BLE001 - the caller's future carries it
                result = exc
            loop.call_soon_threadsafe(_settle, done, result)
        if self.steps.running:
            self.steps.submit(apply)
        else:
            try:
                done.set_result(fn())
            except Exception as exc:  # noqa: BLE001
                done.set_exception(exc)
        return done

    def stats(self) -> dict[str, Any]:
        return {"engine": self.engine.stats(), "pool": self.slots.stats()}

    # -- step batches (event loop) -----------------------------------------------------------
    def _drain(self) -> None:
        touched: dict[int, StepConsumer] = {}
        ready, requests = self.steps.ready, self._requests
        while ready:
            batch = ready.popleft()
            for consumer, handles, counts, tokens in batch.columns:
                consumer.deliver_columns(handles, counts, tokens)    # type: ignore[attr-defined]
                touched[id(consumer)] = consumer
            for rid, exc in batch.failed:
                if isinstance(exc, NeedsFetch):
                    self._fetch_then_add(rid)
                    continue
                req = requests.pop(rid, None)
                if req is not None:
                    if req.timer is not None:
                        req.timer.cancel()
                    req.consumer.fail(req.handle, exc)
                    touched[id(req.consumer)] = req.consumer
            for out in batch.outputs:
                req = requests.get(out.request_id)
                if req is None:
                    continue
                if out.finished:
                    del requests[out.request_id]
                    if req.timer is not None:
                        req.timer.cancel()
                req.consumer.deliver(req.handle, out)
                touched[id(req.consumer)] = req.consumer
            if self.on_step is not None and batch.seconds:
                self.on_step(batch.num_tokens, batch.seconds)
        if self.steps.failure is not None:     # the engine thread stopped: nothing more comes for anyone
            for rid, req in list(requests.items()):
                del requests[rid]
                if req.timer is not None:
                    req.timer.cancel()
                req.consumer.fail(req.handle, self.steps.failure)
                touched[id(req.consumer)] = req.consumer
        for consumer in touched.values():
            consumer.end_batch()

    def _expire(self, request_id: str) -> None:
        req = self._requests.get(request_id)
        if req is None:
            return
        self.cancel(request_id)
        req.consumer.fail(req.handle, DeadlineExceededError(
            f"request {request_id}: the caller's deadline passed before it finished"))
        req.consumer.end_batch()

    # -- adapters ------------------------------------------------------------------------------
    def _fetch_then_add(self, request_id: str) -> None:
        req = self._requests.get(request_id)
        if req is None or req.adm.key is None or req.task_id is None:
            return
        task = self._fetch(req.adm.key, req.task_id, req.version)

        def resubmit(t: asyncio.Task[Uploaded]) -> None:
            exc = asyncio.CancelledError() if t.cancelled() else t.exception()   # read even if no one waits
            if self._requests.get(request_id) is not req:
                return        # cancelled meanwhile
            if exc is not None:
                del self._requests[request_id]
                if req.timer is not None:
                    req.timer.cancel()
                req.consumer.fail(req.handle, exc)
                req.consumer.end_batch()
                return
            req.adm.staged = t.result()
            self.steps.submit(lambda: self.steps.add(req.adm))
        task.add_done_callback(resubmit)

    def _fetch(self, key: str, task_id: int, version: str) -> asyncio.Task[Uploaded]:
        """One fetch and staging per adapter key, shared by every request that waits for it."""
        task = self._fetches.get(key)
        if task is None:
            task = asyncio.create_task(self._fetch_and_stage(key, task_id, version))
            self._fetches[key] = task
            task.add_done_callback(lambda _t: self._fetches.pop(key, None))
        return task

    async def _fetch_and_stage(self, key: str, task_id: int, version: str) -> Uploaded:
        started, num_bytes = time.perf_counter(), 0
        try:
            adapter = await self.fetch(task_id, version or None)
            num_bytes = adapter.num_bytes
            loop = asyncio.get_running_loop()
            staged = await loop.run_in_executor(self._staging, self.slots.stage_adapter, key, adapter)
        except BaseException:
            if self.on_adapter_load is not None:
                self.on_adapter_load(num_bytes, time.perf_counter() - started, False)
            raise
        if self.on_adapter_load is not None:
            self.on_adapter_load(num_bytes, time.perf_counter() - started, True)
        return staged


def write_trace(path: str, trace: Sequence[float]) -> None:
    """Writes a step trace as JSON: `start`, `launched` (its GPU work queued), `end` (time.monotonic of each
    engine.step) and `tokens` (emitted)."""
    Path(path).write_text(json.dumps({name: list(trace[i::4])
                                      for i, name in enumerate(("start", "launched", "end", "tokens"))}))


def _settle(fut: asyncio.Future[Any], result: Any) -> None:
    if fut.done():
        return
    if isinstance(result, BaseException):
        fut.set_exception(result)
    else:
        fut.set_result(result)
