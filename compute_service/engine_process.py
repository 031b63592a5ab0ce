"""The engine process of a compute service run with `--engine-process` (`compute_service.engine_link`
is the other end of its pipe).

It loads and warms up the runtime exactly as a one-process service does
(`compute_service.local_engine`), then serves the pipe on its event loop:
starts and cancels become runner calls, and every drain of the engine's step
batches leaves as one `batch` message (`PipeConsumer`). Its event loop has
no gRPC server to run, so the engine thread shares its GIL with little more
than that drain and the adapter fetches. It ignores SIGINT and SIGTERM (the
gRPC side decides when to stop) and exits when told to or when its pipe
closes (the gRPC side is gone).
"""
from __future__ import annotations

import asyncio
import logging
import pickle
import signal
from multiprocessing.connection import Connection
from typing import Any

from compute_service.config import ComputeConfig
from compute_service.engine.outputs import RequestOutput
from compute_service.engine_link import error_wire, send
from compute_service.local_engine import LocalEngine
from compute_service.runner import EngineRunner
from loraplex.serving import configure_logging, tune_gc

log = logging.getLogger(__name__)


def engine_main(config: ComputeConfig, conn: Connection) -> None:
    """The spawned process's entry point."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    configure_logging(config.log_level, config.log_format, "compute_service.engine")
    try:
        asyncio.run(_main(config, conn))
    except Exception as exc:  # noqa: BLE001 - reported to the gRPC side, which exits on it
        log.exception("the engine process failed: %s", exc)
        try:
            send(conn, ("failed", f"{type(exc).__name__}: {exc}"))
        except OSError:
            pass
        raise SystemExit(1) from None


async def _main(config: ComputeConfig, conn: Connection) -> None:
    engine = await LocalEngine.load(config)
    try:
        send(conn, ("loaded", engine.rt.model_info().SerializeToString()))
        await engine.warm()
        tune_gc()
        send(conn, ("ready",))
        await PipeServer(engine.rt.runner, conn).serve()
    finally:
        await engine.close()
    try:
        send(conn, ("stopped",))
    except OSError:
        pass


class PipeConsumer:
    """Every request of the gRPC side: a drain's deltas and failures leave as one message. The
    unfinished deltas of requests whose gRPC-side consumer is columnar come as columns the engine
    thread grouped (handles, token counts, tokens); the rest as one tuple per delta. Which requests are
    columnar is the gRPC side's word, passed with each start (`PipeServer._apply`), not this class's."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.deltas: list[tuple[int, list[int], bool, str | None, int, int]] = []
        self.failed: list[tuple[int, str, str]] = []
        self.handles: list[int] = []
        self.counts: list[int] = []
        self.tokens: list[int] = []

    def deliver_columns(self, handles: list[int], counts: list[int], tokens: list[int]) -> None:
        self.handles += handles
        self.counts += counts
        self.tokens += tokens

    def deliver(self, handle: int, out: RequestOutput) -> None:
        self.deltas.append((handle, out.new_token_ids, out.finished, out.finish_reason, out.num_prompt_tokens,
                            out.num_output_tokens))

    def fail(self, handle: int, exc: BaseException) -> None:
        self.failed.append((handle, *error_wire(exc)))

    def end_batch(self) -> None:
        if self.deltas or self.failed or self.handles:
            msg = ("batch", self.deltas, self.failed, (self.handles, self.counts, self.tokens))
            self.deltas, self.failed = [], []
            self.handles, self.counts, self.tokens = [], [], []
            try:
                send(self.conn, msg)
            except OSError:
                pass          # the gRPC side is gone; the pipe's reader stops the engine


class PipeServer:
    """Applies the gRPC side's messages to the runner until `stop` or the pipe's end."""

    def __init__(self, runner: EngineRunner, conn: Connection) -> None:
        self.runner = runner
        self.conn = conn
        self.consumer = PipeConsumer(conn)
        self._done: asyncio.Future[None] | None = None

    async def serve(self) -> None:
        loop = asyncio.get_running_loop()
        self._done = loop.create_future()
        loop.add_reader(self.conn.fileno(), self._readable)
        try:
            await self._done
        finally:
            loop.remove_reader(self.conn.fileno())

    def _readable(self) -> None:
        try:
            while self.conn.poll():
                self._apply(pickle.loads(self.conn.recv_bytes()))
        except (EOFError, OSError):
            log.warning("the gRPC side of the compute service is gone: stopping the engine")
            self._finish()
        self.consumer.end_batch()      # refusals of starts, at once

    def _finish(self) -> None:
        if self._done is not None and not self._done.done():
            self._done.set_result(None)

    def _apply(self, msg: tuple[Any, ...]) -> None:
        kind = msg[0]
        if kind == "start":
            _, handle, rid, prompt, params, task_id, version, timeout_s, columnar = msg
            try:
                self.runner.start_request(rid, prompt, params, task_id, version, self.consumer, handle, timeout_s,
                                          columnar)
            except Exception as exc:  # noqa: BLE001 - the request's caller hears it
                self.consumer.fail(handle, exc)
        elif kind == "cancel":
            self.runner.cancel(msg[2])
        elif kind == "call":
            asyncio.ensure_future(self._call(msg[1], msg[2], msg[3]))
        elif kind == "stop":
            self._finish()
        else:
            log.warning("engine process: unknown message %r", kind)

    async def _call(self, cid: int, name: str, args: tuple[Any, ...]) -> None:
        try:
            if name == "prefetch":
                value: Any = await self.runner.prefetch(*args)
            elif name == "drop":
                value = await self.runner.drop(*args)
            elif name == "snapshot":
                value = await self.runner.snapshot()
            else:
                raise ValueError(f"unknown call {name!r}")
            reply: tuple[Any, ...] = ("reply", cid, True, value)
        except Exception as exc:  # noqa: BLE001 - the caller's future carries it
            reply = ("reply", cid, False, error_wire(exc))
        try:
            send(self.conn, reply)
        except OSError:
            self._finish()
