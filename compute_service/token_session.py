"""One StreamTokens call: many requests over one stream, one message per engine step batch.

The caller (a gateway) sends starts and cancels; each start is registered
with the runner under the caller's handle, with this session as its consumer.
Deltas of a step batch accumulate in plain lists (columnar: handles, token
counts, token ids) and become one `StreamTokensResponse` when the writer is
free: while the caller is slow to read, the next steps' deltas join the same
message instead of queueing messages. A request's error is an entry of the
message; the call itself fails only when its connection does, and then every
request it still has open is aborted (KV blocks and adapter pins freed).
"""
from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncIterator

from compute_service.conversions import finish_of, sampling_from_proto
from compute_service.engine.outputs import RequestOutput
from compute_service.request_errors import status_of
from compute_service.runner import EngineRunner
from loraplex.errors import InvalidArgumentError
from loraplex.v1 import compute_pb2

_SESSION_NUMBERS = itertools.count(1)
log = logging.getLogger(__name__)


class TokenSession:
    """Serves one StreamTokens call for `runner`; iterate `run(requests)` for the responses."""

    def __init__(self, runner: EngineRunner) -> None:
        self.runner = runner
        self.number = next(_SESSION_NUMBERS)
        self._open: dict[int, str] = {}      # handle -> the runner's request id
        self._handles: list[int] = []
        self._counts: list[int] = []
        self._tokens: list[int] = []
        self._finished: list[compute_pb2.TokensFinished] = []
        self._errors: list[compute_pb2.TokensError] = []
        self._ready = asyncio.Event()

    # -- the runner's consumer protocol ----------------------------------------------------
    columnar = True     # a step's unfinished deltas come grouped (`deliver_columns`)

    def deliver_columns(self, handles: list[int], counts: list[int], tokens: list[int]) -> None:
        """A step's unfinished deltas of this call's requests, grouped by the engine thread. A request
        cancelled or failed while its step ran may still be among them: its handle is no longer open,
        and its tokens are dropped here, so nothing follows a request's end on the call."""
        open_ = self._open
        keep = [h in open_ for h in handles]
        if all(keep):
            self._handles += handles
            self._counts += counts
            self._tokens += tokens
            return
        pos = 0
        for h, n, k in zip(handles, counts, keep):
            if k:
                self._handles.append(h)
                self._counts.append(n)
                self._tokens += tokens[pos:pos + n]
            pos += n

    def deliver(self, handle: int, out: RequestOutput) -> None:
        ids = out.new_token_ids
        if ids:
            self._handles.append(handle)
            self._counts.append(len(ids))
            self._tokens += ids
        if out.finished:
            rid = self._open.pop(handle, None)
            reason, usage = finish_of(out)
            if rid is not None and log.isEnabledFor(logging.DEBUG):
                log.debug("finished (%s): %d prompt, %d output tokens", out.finish_reason, out.num_prompt_tokens,
                          out.num_output_tokens, extra={"request_id": rid.rsplit("@", 1)[0]})
            self._finished.append(compute_pb2.TokensFinished(handle=handle, finish_reason=reason, usage=usage))

    def fail(self, handle: int, exc: BaseException) -> None:
        rid = self._open.pop(handle, None)
        if rid is not None:
            log.info("failed: %s", exc, extra={"request_id": rid.rsplit("@", 1)[0]})
        self._error(handle, exc)

    def _error(self, handle: int, exc: BaseException) -> None:
        code, text = status_of(exc)
        self._errors.append(compute_pb2.TokensError(handle=handle, code=code.value[0], message=text))

    def end_batch(self) -> None:
        self._ready.set()

    # -- the call --------------------------------------------------------------------------
    async def run(self, requests: AsyncIterator[compute_pb2.StreamTokensRequest]
                  ) -> AsyncIterator[compute_pb2.StreamTokensResponse]:
        """Yields the responses until the caller closed its side and every request ended."""
        reader = asyncio.create_task(self._read(requests), name=f"token-session-{self.number}")
        try:
            while True:
                await self._ready.wait()
                self._ready.clear()
                msg = self._take()
                if msg is not None:
                    yield msg
                if reader.done():
                    reader.result()          # a broken read ends the call (and aborts what is open)
                    if not self._open and not self._has_pending():
                        return
        finally:
            reader.cancel()
            for rid in self._open.values():
                self.runner.cancel(rid)
            self._open.clear()

    async def _read(self, requests: AsyncIterator[compute_pb2.StreamTokensRequest]) -> None:
        try:
            async for req in requests:
                for start in req.start:
                    self._start(start)
                for handle in req.cancel:
                    rid = self._open.pop(handle, None)
                    if rid is not None:
                        self.runner.cancel(rid)
                if self._has_pending():
                    self._ready.set()
        finally:
            self._ready.set()

    def _start(self, start: compute_pb2.StartTokens) -> None:
        handle, request = start.handle, start.request
        try:
            if handle in self._open:
                raise InvalidArgumentError(f"handle {handle} is already open on this call; use a new one")
            params = sampling_from_proto(request.sampling)
            task_id, version = None, ""
            if request.HasField("adapter"):
                task_id, version = request.adapter.task_id, request.adapter.version
            rid = f"{request.request_id}@{self.number}.{handle}"
            self.runner.start_request(rid, request.input_ids, params, task_id, version, self, handle,
                                      start.timeout_s or None)
            self._open[handle] = rid
            if log.isEnabledFor(logging.DEBUG):
                log.debug("started: %d prompt tokens, adapter %s", len(request.input_ids),
                          task_id if task_id is not None else "none", extra={"request_id": request.request_id})
        except Exception as exc:  # noqa: BLE001 - reported for this request only
            self._error(handle, exc)

    def _has_pending(self) -> bool:
        return bool(self._handles or self._finished or self._errors)

    def _take(self) -> compute_pb2.StreamTokensResponse | None:
        if not self._has_pending():
            return None
        msg = compute_pb2.StreamTokensResponse(handles=self._handles, num_tokens=self._counts,
                                               token_ids=self._tokens, finished=self._finished,
                                               errors=self._errors)
        self._handles, self._counts, self._tokens, self._finished, self._errors = [], [], [], [], []
        return msg
