"""The engine thread: the one owner of the engine and the paged adapter slots, stepping without pause.

The event loop never touches the engine or the slots while serving: it appends
commands (`submit`), which this thread applies between two steps, and it
receives each step's outputs through `StepLoop.ready`, handed over with one
`call_soon_threadsafe` per batch of steps (none while the previous batch is
still unread). So the loop turns step after step without an asyncio hop, and
the event loop builds the step's messages while the next step runs.

The hand-off of step N's outputs waits until step N+1 has queued its GPU work
(`LLMEngine.on_launched`): both threads share one GIL, and an event loop woken
at the end of step N would run its Python (drain, messages, gRPC writes)
interleaved with step N+1's scheduling and launches, which then take that much
longer; woken after the launch, it runs while this thread waits for the GPU.
When no step follows (nothing running), or the step sampled some request's
first token (a time to first token, not worth a step's wait), the hand-off is
immediate.

Commands travel in a `collections.deque` (append and popleft are atomic), the
wake-up is a `threading.Event`: nothing on the hot path takes a lock.
"""
from __future__ import annotations

import asyncio
import logging
from array import array
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from compute_service.adapter_cache.paged_slots import PagedAdapterSlots
from compute_service.adapter_cache.staging import Uploaded
from compute_service.engine.llm_engine import LLMEngine
from compute_service.engine.outputs import RequestOutput
from compute_service.engine.sampling_params import SamplingParams
from compute_service.engine.sequence import Sequence
from loraplex.errors import UnavailableError

log = logging.getLogger(__name__)
IDLE_POLL_S = 0.001   # how often an idle loop checks copies in flight
# When step N's outputs go to the event loop: once step N+1's GPU work is queued, once step N+1 is about to
# wait for its tokens (its sampling queued as well), or at once at the end of step N.
HANDOFFS = ("launch", "read", "step_end")


class NeedsFetch(Exception):
    """The request's adapter is neither in the pool nor staged: the event loop fetches it and resubmits."""


@dataclass
class Admission:
    """A request to add to the engine (built on the event loop, applied on the engine thread)."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    key: str | None = None              # adapter key, None: the base model
    staged: Uploaded | None = None      # the adapter's staged rows, when the event loop fetched them
    # Where its deltas go (`runner._Request`: consumer, handle, columnar, timings); None: the event
    # loop routes them by request id.
    route: Any = None


@dataclass
class StepBatch:
    """What one step (or the commands before it) produced, for the event loop."""

    outputs: list[RequestOutput] = field(default_factory=list)
    failed: list[tuple[str, BaseException]] = field(default_factory=list)   # (request id, why)
    # Unfinished deltas of columnar consumers, grouped on this thread: (consumer, handles, token
    # counts, tokens concatenated in handle order).
    columns: list[tuple[Any, list[int], list[int], list[int]]] = field(default_factory=list)
    num_tokens: int = 0
    seconds: float = 0.0


class StepLoop:
    """Runs `engine.step()` back to back on its own thread; `submit` is the only way in."""

    def __init__(self, engine: LLMEngine, slots: PagedAdapterSlots,
                 on_ready: Callable[[], None], trace: bool = False, handoff: str = "launch") -> None:
        self.engine = engine
        self.slots = slots
        self._on_ready = on_ready          # called on the event loop when `ready` has batches
        self._commands: deque[Callable[[], None]] = deque()
        self._wake = threading.Event()
        self.ready: deque[StepBatch] = deque()
        self._posted = False               # a drain of `ready` is scheduled on the event loop
        self._keys: dict[str, str | None] = {}   # request id -> adapter key, for requests in the engine
        self._routes: dict[str, Any] = {}        # request id -> its route (`Admission.route`), until it ends
        self.latency: Any = None                 # per-sequence timings, observed here (`SequenceObserver`)
        self._routed_at = 0.0                    # perf_counter of the last step's routing (latency metrics)
        self._failed: list[tuple[str, BaseException]] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.num_steps = 0
        if handoff not in HANDOFFS:
            raise ValueError(f"handoff: expected one of {HANDOFFS}, got {handoff!r}")
        self.handoff = handoff
        self.failure: UnavailableError | None = None   # set when the thread stopped on an error
        # Per step: monotonic start of engine.step(), when its GPU work was queued, its end, and the
        # tokens it emitted (benchmarks); 32 bytes a step, no Python objects for the collector.
        self.trace: array[float] | None = array("d") if trace else None
        self._launched_at = 0.0

    # -- from the event loop ------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._stopping = False
        self.engine.on_launched = self._on_launched
        self.engine.on_reading = self._hand_off if self.handoff == "read" else None
        self._thread = threading.Thread(target=self._run, name="engine-steps", daemon=True)
        self._thread.start()

    def submit(self, command: Callable[[], None]) -> None:
        """Runs `command` on the engine thread before the next step; raises once the thread stopped on an error."""
        if self.failure is not None:
            raise self.failure
        self._commands.append(command)
        self._wake.set()

    def stop(self) -> None:
        """Ends the thread after its current step (blocking: call it from a worker thread)."""
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.engine.on_launched = None
        self.engine.on_reading = None

    @property
    def running(self) -> bool:
        return self._thread is not None

    # -- commands (engine thread) -------------------------------------------------------------
    def add(self, adm: Admission) -> None:
        """Adds a request; a failure (or a missing adapter) is reported with the next batch."""
        key = adm.key
        try:
            if key is not None:
                if not self.slots.offer(key, adm.staged):
                    raise NeedsFetch(key)
                self.slots.want(key)
            try:
                # A columnar route rides on the sequence: its plain deltas skip the `RequestOutput`.
                route = adm.route if adm.route is not None and adm.route.columnar else None
                self.engine.add_request(adm.request_id, adm.prompt, adm.params, key, route)
            except BaseException:
                if key is not None:
                    self.slots.unwant(key)
                raise
            self._keys[adm.request_id] = key
            if adm.route is not None:
                self._routes[adm.request_id] = adm.route
        except Exception as exc:  # noqa: BLE001 - the request's caller reports it
            self._failed.append((adm.request_id, exc))

    def abort(self, request_id: str) -> None:
        """Aborts a request: its KV blocks and adapter pin are released now."""
        if request_id in self._keys:
            self.engine.abort_request(request_id)

    # -- the thread -----------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._turn()
        except Exception as exc:  # noqa: BLE001 - anything a step does not catch ends the engine thread
            log.exception("the engine thread stopped: %s; its requests fail with UNAVAILABLE and new ones are "
                          "refused until the compute service restarts", exc)
            self.failure = UnavailableError(f"the compute service's engine stopped ({type(exc).__name__}: {exc}); "
                                            "restart the compute service")
            self.ready.append(StepBatch())      # a drain, which fails every request the event loop holds
            self._hand_off()
            return
        self.slots.wait_loads()

    def _turn(self) -> None:
        while not self._stopping:
            self._wake.clear()
            self._apply_commands()
            self.slots.pump()
            self._fail_loads()
            if self.engine.has_unfinished():
                self._step()
                if self.engine.scheduler.running or self.engine.in_flight:
                    continue          # the next step's launch hands this one's outputs over
                self._hand_off()
                if self._commands:
                    continue
                # Every request waits for an adapter copy: poll the copies, do not spin.
                self._wake.wait(IDLE_POLL_S)
            else:
                self._post(StepBatch())
                self._hand_off()
                self._wake.wait(IDLE_POLL_S if self.slots.loading else None)

    def _apply_commands(self) -> None:
        while self._commands:
            try:
                self._commands.popleft()()
            except Exception:  # noqa: BLE001 - one bad command must not stop the engine
                log.exception("engine command failed")

    def _step(self) -> None:
        t0 = time.monotonic()
        try:
            outputs = self.engine.step()
        except Exception as exc:  # noqa: BLE001 - a broken step fails its requests, not the service
            log.exception("engine step failed; failing the requests in the engine")
            self._fail_all(exc)
            self._hand_off()
            return
        t1 = time.monotonic()
        self._hand_off()          # a step that launched nothing did not hand the previous outputs over
        self.num_steps += 1
        emitted, passed, columns = self._route(outputs, self.engine.routed)
        if self.trace is not None:
            self.trace.extend((t0, self._launched_at or t0, t1, float(emitted)))
            self._launched_at = 0.0
        self._post(StepBatch(passed, [], num_tokens=emitted, seconds=t1 - t0, columns=list(columns.values())))
        if self.engine.in_flight or self.engine.sampled_first:
            # Overlapped steps: these are the tokens of the step before the one now on the GPU, which
            # runs while the event loop builds their messages; waiting for the next launch would hold
            # them a step longer. A step that sampled first tokens goes out at once too: held for the
            # next step's read, a request's first token waited for that step's scheduling, launches and
            # sampling (on the CPU, its whole forward pass).
            self._hand_off()

    def _route(self, outputs: list[RequestOutput], routed: list[Sequence]
               ) -> tuple[int, list[RequestOutput], dict[int, tuple[Any, list[int], list[int], list[int]]]]:
        """A step's outputs and its routed sequences (`LLMEngine.routed`: one new token each, unfinished,
        their route columnar): (tokens emitted, the outputs the event loop routes, the columns of columnar
        consumers). Here, not on the event loop, so the per-sequence Python of a step runs on this
        thread while it waits for nothing, instead of in a second thread that takes the GIL from it
        at every release; the latency metrics are observed here for the same reason. A request's last
        delta goes to the event loop, which ends it (timers, its consumer's `deliver`).

        Per sequence this is the hot loop of a served decode step (256 sequences a step), so it is
        written flat: a sequence that also got a token in the step before (its `last_token_at` is that
        step's routing time) adds to one inter-token observation for the step instead of making its own."""
        routes, latency = self._routes, self.latency
        now = time.perf_counter() if latency is not None else 0.0
        prev = self._routed_at
        emitted = steady = 0
        passed: list[RequestOutput] = []
        columns: dict[int, tuple[Any, list[int], list[int], list[int]]] = {}
        last_consumer: Any = None
        col: tuple[Any, list[int], list[int], list[int]] = (None, [], [], [])
        for out in outputs:
            new = out.new_token_ids
            n = len(new)
            emitted += n
            if out.finished:
                rid = out.request_id
                key = self._keys.pop(rid, None)
                if key is not None:
                    self.slots.unwant(key)
                route = routes.pop(rid, None)
                if route is not None and latency is not None:
                    latency.delivered(route, out, now)
                passed.append(out)
                continue
            route = routes.get(out.request_id)
            if route is None:
                passed.append(out)
                continue
            if n and latency is not None:
                if n == 1 and prev and route.last_token_at == prev:
                    steady += 1
                    route.last_token_at = now
                else:
                    latency.delivered(route, out, now)
            if not route.columnar:
                passed.append(out)
            elif n:
                consumer = route.consumer
                if consumer is not last_consumer:
                    col, last_consumer = _column(columns, consumer), consumer
                col[1].append(route.handle)
                col[2].append(n)
                col[3].extend(new)
        # The common case of a decode step: no `RequestOutput` was made for these.
        emitted += len(routed)
        for seq in routed:
            route = seq.route
            if latency is not None:
                if prev and route.last_token_at == prev:
                    steady += 1
                    route.last_token_at = now
                else:       # a first token, or the first after a pause: observed on its own
                    n_prompt = seq.num_prompt_tokens
                    latency.delivered(route, RequestOutput(seq.request_id, seq.token_ids[-1:], False, None,
                                                           n_prompt, len(seq.token_ids) - n_prompt), now)
            consumer = route.consumer
            if consumer is not last_consumer:
                col, last_consumer = _column(columns, consumer), consumer
            col[1].append(route.handle)
            col[2].append(1)
            col[3].append(seq.token_ids[-1])
        if latency is not None:
            if steady:
                latency.steady(now - prev, steady)
            self._routed_at = now
        return emitted, passed, columns

    def _fail_loads(self) -> None:
        for key, exc in list(self.slots.failed.items()):
            del self.slots.failed[key]
            for rid, k in list(self._keys.items()):
                if k == key:
                    self.engine.abort_request(rid)
                    del self._keys[rid]
                    self._failed.append((rid, exc))

    def _fail_all(self, exc: BaseException) -> None:
        for rid, key in list(self._keys.items()):
            self.engine.abort_request(rid)
            if key is not None:
                self.slots.unwant(key)
            self._failed.append((rid, exc))
        self._keys.clear()   # the aborted requests' final deltas come with the next step, for no one

    def _post(self, batch: StepBatch) -> None:
        """Queues a batch for the event loop (`_hand_off` wakes it)."""
        batch.failed, self._failed = self._failed, []
        if not (batch.outputs or batch.failed or batch.num_tokens):
            return
        self.ready.append(batch)
        if self.handoff == "step_end":
            self._hand_off()

    def _on_launched(self) -> None:
        if self.trace is not None:
            self._launched_at = time.monotonic()
        if self.handoff == "launch":
            self._hand_off()

    def _hand_off(self) -> None:
        """Wakes the event loop for the queued batches: one wake-up per drain, not per step."""
        if self.ready and not self._posted and self._loop is not None:
            self._posted = True
            self._loop.call_soon_threadsafe(self._drained)

    def _drained(self) -> None:
        self._posted = False     # before reading: a batch appended from now on schedules its own drain
        self._on_ready()


def _column(columns: dict[int, tuple[Any, list[int], list[int], list[int]]], consumer: Any
            ) -> tuple[Any, list[int], list[int], list[int]]:
    """`consumer`'s column of the step (handles, token counts, tokens), made on its first delta."""
    got = columns.get(id(consumer))
    if got is None:
        got = columns[id(consumer)] = (consumer, [], [], [])
    return got
