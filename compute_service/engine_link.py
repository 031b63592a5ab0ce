"""The gRPC side of a compute service whose engine runs in a child process (`--engine-process`).

Both sides of one process shared a GIL: the engine thread gave it up at every
torch call and waited to take it back while the event loop ran gRPC's
callbacks and built messages (measured on an H200 at 128 streams: 45 % of the
engine thread's busy time waiting for the GIL; docs/compute.md). Here the
engine, its runner, adapter fetches and metrics live in
`compute_service.engine_process`; this process keeps the gRPC server and
talks to it over one pipe:

- to the engine: `start` (a request, under a handle of this side, and whether
  its consumer here is columnar), `cancel` (handle and request id),
  `call` (prefetch, drop, stats) and `stop`;
- from it: `loaded` (the model's description), `ready` (warmed up), one
  `batch` per drain of the engine's step batches (the last delta of every
  request, and every delta of a non-columnar consumer's, as
  `(handle, token ids, finished, finish reason, prompt tokens, output tokens)`;
  the failures as `(handle, status code name, message)`; the other deltas as
  columns `(handles, token counts, tokens)` that the engine thread grouped),
  `reply` to a call.

Messages are pickled tuples. `RemoteRunner` offers what the servicer and the
token sessions use of `EngineRunner` (start_request, cancel, generate,
prefetch, drop, snapshot). If the engine process dies, every open request and
call fails with UNAVAILABLE, new ones are refused the same way, and the log
says so once.
"""
from __future__ import annotations

import asyncio
import logging
import multiprocessing
import pickle
from collections.abc import AsyncIterator, Sequence
from multiprocessing.connection import Connection
from typing import Any

import grpc

from compute_service.config import ComputeConfig
from compute_service.engine.outputs import RequestOutput
from compute_service.engine.sampling_params import SamplingParams
from compute_service.engine_spawn import spawn_engine
from compute_service.request_errors import status_of
from compute_service.runner import StepConsumer, generate_with
from loraplex import errors
from loraplex.v1 import common_pb2

log = logging.getLogger(__name__)
STOP_TIMEOUT_S = 60.0     # how long `stop` waits for the engine process to finish its steps and exit


def error_wire(exc: BaseException) -> tuple[str, str]:
    """An exception as it crosses the pipe: its status code's name and message."""
    code, text = status_of(exc)
    return code.name, text


def error_from_wire(code_name: str, text: str) -> errors.LoraplexError:
    code = grpc.StatusCode[code_name]
    cls = errors.BY_GRPC_CODE.get(code)
    if cls is not None:
        return cls(text)
    exc = errors.LoraplexError(text)
    exc.grpc_code = code          # DEADLINE_EXCEEDED, INTERNAL, or any code without a class of its own
    return exc


def send(conn: Connection, msg: tuple[Any, ...]) -> None:
    conn.send_bytes(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))


class RemoteRuntime:
    """What the servicer serves: the remote runner and the model's description."""

    def __init__(self, runner: "RemoteRunner", info: common_pb2.ModelInfo) -> None:
        self.runner = runner
        self.info = info

    def model_info(self) -> common_pb2.ModelInfo:
        return self.info


class RemoteRunner:
    """`EngineRunner`'s interface over the pipe to the engine process; every method runs on the event loop."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._open: dict[int, tuple[str, StepConsumer, int]] = {}   # handle -> (request id, consumer, its handle)
        self._handles: dict[str, int] = {}                           # request id -> handle
        self._next_handle = 1
        self._calls: dict[int, asyncio.Future[Any]] = {}
        self._next_call = 1
        self.failure: errors.UnavailableError | None = None

    # -- requests ------------------------------------------------------------------------
    def start_request(self, request_id: str, prompt: Sequence[int], params: SamplingParams,
                      task_id: int | None, version: str, consumer: StepConsumer, handle: int,
                      timeout_s: float | None = None) -> None:
        if self.failure is not None:
            raise self.failure
        if request_id in self._handles:
            raise errors.InvalidArgumentError(f"request id {request_id!r} is already running; use a new id")
        h = self._next_handle
        self._next_handle += 1
        try:
            send(self._conn, ("start", h, request_id, list(prompt), params, task_id, version, timeout_s,
                              bool(getattr(consumer, "columnar", False))))
        except OSError as exc:
            self.lost(f"the pipe to the engine process broke ({exc})")
            raise self.failure from None  # type: ignore[misc]
        self._open[h] = (request_id, consumer, handle)
        self._handles[request_id] = h

    def cancel(self, request_id: str) -> None:
        h = self._handles.pop(request_id, None)
        if h is None:
            return
        del self._open[h]
        if self.failure is None:
            self._send(("cancel", h, request_id))

    def generate(self, request_id: str, prompt: Sequence[int], params: SamplingParams,
                 task_id: int | None = None, version: str = "") -> AsyncIterator[RequestOutput]:
        return generate_with(self, request_id, prompt, params, task_id, version)

    # -- calls -----------------------------------------------------------------------------
    def prefetch(self, task_id: int, version: str) -> asyncio.Future[bool]:
        return self._call("prefetch", task_id, version)

    def drop(self, task_id: int) -> asyncio.Future[bool]:
        return self._call("drop", task_id)

    def snapshot(self) -> asyncio.Future[tuple[Any, Any]]:
        return self._call("snapshot")

    def _call(self, name: str, *args: Any) -> asyncio.Future[Any]:
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        if self.failure is not None:
            fut.set_exception(self.failure)
            return fut
        cid = self._next_call
        self._next_call += 1
        self._calls[cid] = fut
        self._send(("call", cid, name, args))
        return fut

    # -- the pipe --------------------------------------------------------------------------
    def _send(self, msg: tuple[Any, ...]) -> None:
        """A cancel or call; a broken pipe fails everything open (this call's future included)."""
        try:
            send(self._conn, msg)
        except OSError as exc:
            self.lost(f"the pipe to the engine process broke ({exc})")

    def received(self, msg: tuple[Any, ...]) -> None:
        """One message of the engine process (a batch or a reply)."""
        kind = msg[0]
        if kind == "batch":
            self._batch(msg[1], msg[2], msg[3])
        elif kind == "reply":
            fut = self._calls.pop(msg[1], None)
            if fut is not None and not fut.done():
                if msg[2]:
                    fut.set_result(msg[3])
                else:
                    fut.set_exception(error_from_wire(*msg[3]))
        else:
            log.warning("engine process: unexpected message %r", kind)

    def _batch(self, deltas: list[tuple[int, list[int], bool, str | None, int, int]],
               failed: list[tuple[int, str, str]],
               columns: tuple[list[int], list[int], list[int]] = ([], [], [])) -> None:
        touched: dict[int, StepConsumer] = {}
        open_ = self._open
        handles, counts, tokens = columns
        if handles:
            # unfinished deltas of columnar consumers (the engine grouped them): regrouped per consumer
            groups: dict[int, tuple[StepConsumer, list[int], list[int], list[int]]] = {}
            pos = 0
            for h, n in zip(handles, counts):
                entry = open_.get(h)
                if entry is not None:          # else cancelled here meanwhile
                    consumer = entry[1]
                    group = groups.get(id(consumer))
                    if group is None:
                        group = groups[id(consumer)] = (consumer, [], [], [])
                    group[1].append(entry[2])
                    group[2].append(n)
                    group[3].extend(tokens[pos:pos + n])
                pos += n
            for consumer, chs, ns, ts in groups.values():
                consumer.deliver_columns(chs, ns, ts)     # type: ignore[attr-defined]
                touched[id(consumer)] = consumer
        for h, ids, finished, reason, num_prompt, num_output in deltas:
            entry = open_.get(h)
            if entry is None:
                continue          # cancelled here meanwhile
            rid, consumer, ch = entry
            if finished:
                del open_[h]
                del self._handles[rid]
            consumer.deliver(ch, RequestOutput(rid, ids, finished, reason, num_prompt, num_output))
            touched[id(consumer)] = consumer
        for h, code, text in failed:
            entry = open_.pop(h, None)
            if entry is None:
                continue
            rid, consumer, ch = entry
            del self._handles[rid]
            consumer.fail(ch, error_from_wire(code, text))
            touched[id(consumer)] = consumer
        for consumer in touched.values():
            consumer.end_batch()

    def lost(self, why: str) -> None:
        """The engine process is gone: everything open fails with UNAVAILABLE, and so does what comes."""
        if self.failure is not None:
            return
        log.error("the engine process stopped (%s); its requests fail with UNAVAILABLE and new ones are "
                  "refused until the compute service restarts", why)
        self.failure = errors.UnavailableError(f"the compute service's engine process stopped ({why}); "
                                               "restart the compute service")
        open_, self._open = self._open, {}
        self._handles.clear()
        touched: dict[int, StepConsumer] = {}
        for _, consumer, ch in open_.values():
            consumer.fail(ch, self.failure)
            touched[id(consumer)] = consumer
        for consumer in touched.values():
            consumer.end_batch()
        calls, self._calls = self._calls, {}
        for fut in calls.values():
            if not fut.done():
                fut.set_exception(self.failure)


class EngineLink:
    """Starts the engine process and carries its messages to a `RemoteRunner`."""

    def __init__(self, proc: multiprocessing.process.BaseProcess, conn: Connection,
                 info: common_pb2.ModelInfo) -> None:
        self.proc = proc
        self.conn = conn
        self.runner = RemoteRunner(conn)
        self.runtime = RemoteRuntime(self.runner, info)
        self._ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._stopped: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        asyncio.get_running_loop().add_reader(conn.fileno(), self._readable)

    @classmethod
    async def start(cls, config: ComputeConfig,
                    spawned: tuple[multiprocessing.process.BaseProcess, Connection] | None = None) -> "EngineLink":
        """Spawns the engine process (unless `spawned` already did: `engine_spawn.spawn_engine`) and waits
        until its model is loaded (it warms up next)."""
        proc, ours = spawned if spawned is not None else spawn_engine(config)
        log.info("start-up: engine process %d loads the model (--engine-process)", proc.pid)
        msg = await asyncio.to_thread(_first_message, ours, proc)
        if msg[0] != "loaded":
            proc.join(10)
            raise RuntimeError(f"the engine process failed to start: {msg[1]}")
        info = common_pb2.ModelInfo()
        info.ParseFromString(msg[1])
        return cls(proc, ours, info)

    async def warm(self) -> None:
        """Until the engine process warmed up (raises if it died first)."""
        await self._ready

    def _readable(self) -> None:
        try:
            while self.conn.poll():
                msg = pickle.loads(self.conn.recv_bytes())
                kind = msg[0]
                if kind == "ready":
                    if not self._ready.done():
                        self._ready.set_result(None)
                elif kind == "failed":
                    self._gone(msg[1])
                    return
                elif kind == "stopped":
                    if not self._stopped.done():
                        self._stopped.set_result(None)
                else:
                    self.runner.received(msg)
        except (EOFError, OSError):
            if self._stopped.done():          # it exited as asked
                asyncio.get_running_loop().remove_reader(self.conn.fileno())
                return
            self.proc.join(1.0)
            self._gone(f"exit code {self.proc.exitcode}")

    def _gone(self, why: str) -> None:
        loop = asyncio.get_running_loop()
        loop.remove_reader(self.conn.fileno())
        self.runner.lost(why)
        if not self._ready.done():
            self._ready.set_exception(RuntimeError(f"the engine process failed while warming up ({why})"))
        if not self._stopped.done():
            self._stopped.set_result(None)

    async def close(self) -> None:
        """Lets the engine process finish its steps and exit (killed after `STOP_TIMEOUT_S`)."""
        if self.runner.failure is None:
            try:
                send(self.conn, ("stop",))
                await asyncio.wait_for(asyncio.shield(self._stopped), STOP_TIMEOUT_S)
            except (OSError, asyncio.TimeoutError):
                pass
        await asyncio.to_thread(self.proc.join, STOP_TIMEOUT_S)
        if self.proc.is_alive():
            log.warning("the engine process did not exit in %.0f s: killing it", STOP_TIMEOUT_S)
            self.proc.kill()
            await asyncio.to_thread(self.proc.join, 10)
        try:
            asyncio.get_running_loop().remove_reader(self.conn.fileno())
        except (OSError, ValueError):
            pass
        self.conn.close()


def _first_message(conn: Connection, proc: multiprocessing.process.BaseProcess) -> tuple[Any, ...]:
    """The engine process's `loaded` or `failed` (blocking; its exit without either is a failure)."""
    try:
        while not conn.poll(0.5):
            if not proc.is_alive():
                raise EOFError
        return pickle.loads(conn.recv_bytes())
    except (EOFError, OSError):
        proc.join(5)
        return ("failed", f"exit code {proc.exitcode} before the model loaded (see its log lines above)")
