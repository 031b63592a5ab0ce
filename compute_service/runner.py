"""The asyncio loop that drives engine steps and the adapter cache, and streams tokens to callers.

The engine and the adapter cache are not thread-safe, so everything that
changes them (adding and aborting requests, pinning, granting pages) happens
on the event loop between steps; only `engine.step()` itself runs in a worker
thread, so gRPC keeps serving while the model runs. Each loop turn:
apply queued commands -> pump adapter loads -> one engine step -> hand each
request's new tokens to its stream.

A request naming an adapter first awaits `AdapterLoader.prepare` (fetch and
staging, shared per adapter), then enters the engine with a "want" on the
adapter; the scheduler admits it once the copy finished. Cancelling a stream
aborts its request at the next step boundary: KV blocks and the adapter pin
are released there, before the next step runs.
"""
from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from compute_service.adapter_cache.loader import AdapterLoader, adapter_key, task_of
from compute_service.adapter_cache.paged_slots import PagedAdapterSlots
from compute_service.engine.llm_engine import LLMEngine
from compute_service.engine.outputs import RequestOutput
from compute_service.engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)
IDLE_POLL_S = 0.001   # how often an idle loop checks copies in flight


@dataclass
class _Stream:
    queue: asyncio.Queue[RequestOutput | BaseException]
    key: str | None
    in_engine: bool = False
    done: bool = False


class EngineRunner:
    """Owns the engine loop; `generate()` is safe to call from any coroutine on the loop."""

    def __init__(self, engine: LLMEngine, slots: PagedAdapterSlots, loader: AdapterLoader,
                 on_step: Callable[[int, float], None] | None = None) -> None:
        self.engine = engine
        self.slots = slots
        self.loader = loader
        self.on_step = on_step          # (num tokens emitted, step seconds), for metrics and benchmarks
        self._commands: list[Callable[[], None]] = []
        self._streams: dict[str, _Stream] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self.num_steps = 0

    # -- lifecycle -----------------------------------------------------------------
    def start(self, switch_interval_s: float = 0.0) -> None:
        """Starts the loop; `switch_interval_s` > 0 sets Python's thread switch interval.

        The thread running a step gives up the GIL at every kernel launch; with
        Python's default 5 ms interval a side thread that got it (an adapter
        upload or pack) can keep it that long, many times per step.
        """
        if switch_interval_s > 0:
            sys.setswitchinterval(switch_interval_s)
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name="engine-loop")

    async def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        if self._task is not None:
            await self._task
            self._task = None

    # -- requests --------------------------------------------------------------------
    async def generate(self, request_id: str, prompt: Sequence[int], params: SamplingParams,
                       task_id: int | None = None, version: str = "") -> AsyncIterator[RequestOutput]:
        """Streams the request's deltas; the last one has `finished` set. Cancelling aborts it."""
        if request_id in self._streams:
            from compute_service.engine.errors import InvalidRequestError
            raise InvalidRequestError(f"request id {request_id!r} is already running; use a new id")
        key = None if task_id is None else adapter_key(task_id, version)
        st = _Stream(asyncio.Queue(), key)
        self._streams[request_id] = st
        try:
            if key is not None:
                self.slots.claim(key)
                try:
                    await self.loader.prepare(key, task_id, version)  # type: ignore[arg-type]
                except BaseException:
                    self.slots.release(key)
                    raise
            self._submit(lambda: self._add(request_id, list(prompt), params, st))
            while True:
                item = await st.queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            if not st.done:
                self._submit(lambda: self._abort(request_id))
            else:
                self._streams.pop(request_id, None)

    def prefetch(self, task_id: int, version: str) -> asyncio.Future[bool]:
        """Starts loading an adapter with no request behind it; resolves to whether it was resident already."""
        key = adapter_key(task_id, version)
        done: asyncio.Future[bool] = asyncio.get_running_loop().create_future()

        async def run() -> None:
            resident = self.slots.is_ready(key)
            self.slots.claim(key)
            try:
                await self.loader.prepare(key, task_id, version)
            except BaseException as exc:
                self.slots.release(key)
                done.set_exception(exc)
                return

            def apply() -> None:
                self.slots.release(key)
                self.slots.prefetch(key)
                done.set_result(resident)
            self._submit(apply)

        asyncio.create_task(run())
        return done

    def drop(self, task_id: int) -> asyncio.Future[bool]:
        """Drops every version of `task_id` from the GPU cache once unused."""
        done: asyncio.Future[bool] = asyncio.get_running_loop().create_future()

        def apply() -> None:
            res = self.slots.residency
            assert res is not None
            keys = [e.key for e in res.entries() if task_of(e.key) == task_id]
            done.set_result(any([res.drop(k) for k in keys]))
        self._submit(apply)
        return done

    def stats(self) -> dict[str, Any]:
        return {"engine": self.engine.stats(), "pool": self.slots.stats()}

    # -- loop internals ------------------------------------------------------------------
    def _submit(self, command: Callable[[], None]) -> None:
        self._commands.append(command)
        self._wake.set()

    def _add(self, request_id: str, prompt: list[int], params: SamplingParams, st: _Stream) -> None:
        if st.done:
            return
        try:
            if st.key is not None:
                self.slots.want(st.key)
                self.slots.release(st.key)
            try:
                self.engine.add_request(request_id, prompt, params, st.key)
            except BaseException:
                if st.key is not None:
                    self.slots.unwant(st.key)
                raise
            st.in_engine = True
        except Exception as exc:  # noqa: BLE001 - the caller's stream reports it
            st.done = True
            st.queue.put_nowait(exc)

    def _abort(self, request_id: str) -> None:
        st = self._streams.get(request_id)
        if st is None:
            return
        if st.in_engine:
            self.engine.abort_request(request_id)   # frees KV blocks and the pin now
        else:
            self._streams.pop(request_id, None)
        st.done = True

    def _apply_commands(self) -> None:
        commands, self._commands = self._commands, []
        for c in commands:
            c()

    def _fail_loads(self) -> None:
        for key, exc in list(self.slots.failed.items()):
            del self.slots.failed[key]
            for rid, st in list(self._streams.items()):
                if st.key == key and st.in_engine:
                    self.engine.abort_request(rid)
                    st.in_engine = False
                    st.done = True
                    st.queue.put_nowait(exc)

    def _fail_all(self, exc: BaseException) -> None:
        for rid, st in list(self._streams.items()):
            if st.in_engine:
                self.engine.abort_request(rid)
                if st.key is not None:
                    self.slots.unwant(st.key)
                st.in_engine = False
                if not st.done:
                    st.done = True
                    st.queue.put_nowait(exc)
                self._streams.pop(rid, None)

    def _dispatch(self, outputs: list[RequestOutput]) -> int:
        emitted = 0
        for out in outputs:
            emitted += len(out.new_token_ids)
            st = self._streams.get(out.request_id)
            if st is None:
                continue
            if out.finished:
                if st.key is not None and st.in_engine:
                    self.slots.unwant(st.key)
                st.in_engine = False
                self._streams.pop(out.request_id, None)
                if st.done:        # aborted by its caller, who is gone
                    continue
                st.done = True
            st.queue.put_nowait(out)
        return emitted

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while not self._stopping:
            self._wake.clear()
            self._apply_commands()
            self.slots.pump()
            self._fail_loads()
            if self.engine.has_unfinished():
                t0 = loop.time()
                try:
                    outputs = await asyncio.to_thread(self.engine.step)
                except Exception as exc:  # noqa: BLE001 - a broken step fails its requests, not the service
                    log.exception("engine step failed; failing the requests in the engine")
                    self._fail_all(exc)
                    continue
                self.num_steps += 1
                emitted = self._dispatch(outputs)
                if self.on_step is not None:
                    self.on_step(emitted, loop.time() - t0)
                if outputs or self.engine.stats().num_running:
                    continue
                # Every request waits for an adapter copy: poll the copies, do not spin.
                await self._sleep_or_wake(IDLE_POLL_S)
            elif self.slots.loading:
                await self._sleep_or_wake(IDLE_POLL_S)
            else:
                await self._wake.wait()
        self.slots.wait_loads()

    async def _sleep_or_wake(self, seconds: float) -> None:
        try:
            await asyncio.wait_for(self._wake.wait(), seconds)
        except asyncio.TimeoutError:
            pass
