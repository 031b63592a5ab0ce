"""One Generate call: a compute stream per entry, detokenized, stop strings cut, merged.

`entry_stream` runs one entry (one adapter, or the base model) on a compute
replica and yields public `GenerateResponse`s: each carries every token that
arrived since the client took the previous one (coalesced, detokenized once),
so a slow reader gets fewer, fuller messages. When a stop string appears it
cancels the request on compute, so the sequence's KV blocks and adapter pin
are released at once. `merge_entries` runs several entries concurrently (they land
in the same batches on the compute service) and interleaves their messages;
an entry that fails ends with finish_reason ERROR and never disturbs the others.
`run_entries` is what every front end calls (the gRPC Generate and the
HTTP API): one entry streams alone, several are merged. An entry whose adapter
version compute no longer finds (NOT_FOUND before any token: the gateway's
resolution was stale) is resolved again by the host cache and started once more.
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import AsyncIterator, Awaitable, Callable, Sequence

import grpc

from loraplex.detokenize import StopStringMatcher
from loraplex.errors import UnavailableError
from loraplex.logging_setup import REQUEST_ID
from loraplex.v1 import common_pb2, compute_pb2, gateway_pb2
from gateway.adapters import AdapterResolver, ResolvedLora
from gateway.downstream import DownstreamError, from_rpc_error
from gateway.metrics import EntryClock
from gateway.requests import PromptCodec
from gateway.router import ComputeRouter

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EntryJob:
    """Everything one entry of a Generate call needs."""

    index: int
    request_id: str
    prompt_ids: Sequence[int]
    sampling: common_pb2.SamplingParams   # as sent to compute (defaults filled, no stop strings)
    stop: Sequence[str]
    timeout_s: float | None               # the caller's remaining deadline, passed on to compute


def _response(job: EntryJob, lora: ResolvedLora, token_ids: Sequence[int], text: str,
              finish: common_pb2.FinishReason = common_pb2.FINISH_REASON_UNSPECIFIED, completion_tokens: int = 0,
              error: str = "") -> gateway_pb2.GenerateResponse:
    msg = gateway_pb2.GenerateResponse(index=job.index, token_ids=list(token_ids), text=text,
                                       finish_reason=finish, error=error)
    if lora.task_id is not None:
        msg.task_id, msg.has_task_id = lora.task_id, True
    if finish != common_pb2.FINISH_REASON_UNSPECIFIED:
        msg.usage.prompt_tokens = len(job.prompt_ids)
        msg.usage.completion_tokens = completion_tokens
    return msg


async def entry_stream(job: EntryJob, lora: ResolvedLora, router: ComputeRouter,
                       codec: PromptCodec) -> AsyncIterator[gateway_pb2.GenerateResponse]:
    """Runs one entry on compute; yields its messages, the last one with finish_reason and usage."""
    request = compute_pb2.GenerateTokensRequest(request_id=job.request_id, input_ids=list(job.prompt_ids),
                                                sampling=job.sampling)
    if lora.task_id is not None:
        request.adapter.task_id, request.adapter.version = lora.task_id, lora.version
    detok = codec.detokenizer(job.prompt_ids)
    matcher = StopStringMatcher(job.stop)
    completion = 0
    REQUEST_ID.set(job.request_id)       # this entry's log lines carry its id
    clock = EntryClock()
    # the router retries on another replica until the request's first tokens are in
    async with router.stream(lora.task_id, request, job.timeout_s) as call:
        try:
            async for batch in call:
                completion += len(batch.token_ids)
                clock.tokens(len(batch.token_ids))
                text, stopped = matcher.push(detok.push(batch.token_ids))
                if stopped:
                    call.cancel()  # frees the sequence on compute now, not after max_tokens
                    yield _response(job, lora, batch.token_ids, text, common_pb2.STOP, completion)
                    return
                if batch.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
                    tail, stopped = matcher.push(detok.flush())
                    finish = common_pb2.STOP if stopped else batch.finish_reason
                    tail += "" if stopped else matcher.flush()
                    used = completion if stopped or batch.usage is None else batch.usage.completion_tokens
                    yield _response(job, lora, batch.token_ids, text + tail, finish, used)
                    return
                if batch.token_ids or text:
                    yield _response(job, lora, batch.token_ids, text)
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc, "compute", call.address) from exc
        finally:
            clock.end()
            if not call.done():
                call.cancel()  # the caller went away (cancel, deadline) or we failed: tell compute
    raise UnavailableError(f"the compute service at {call.address} ended request {job.request_id} "
                           "without a finish reason")


async def adapter_entry_stream(entry: Entry, lora: ResolvedLora, resolver: AdapterResolver, router: ComputeRouter,
                               codec: PromptCodec) -> AsyncIterator[gateway_pb2.GenerateResponse]:
    """`entry_stream`, started once more at the version the host cache names now when compute answers
    NOT_FOUND for `lora` before any message was sent (the version was replaced or evicted meanwhile)."""
    sent = False
    try:
        async for msg in entry_stream(entry.job, lora, router, codec):
            sent = True
            yield msg
        return
    except DownstreamError as exc:
        if sent or lora.is_base or exc.grpc_code != grpc.StatusCode.NOT_FOUND:
            raise
        log.info("compute has no task id %d at version %s (%s): resolving %s again", lora.task_id,
                 lora.version, exc, entry.what)
    lora = await resolver.resolve_again(entry.spec, lora, entry.what)
    async for msg in entry_stream(entry.job, lora, router, codec):
        yield msg


async def resolved_entry_stream(entry: Entry, resolver: AdapterResolver, router: ComputeRouter,
                                codec: PromptCodec) -> AsyncIterator[gateway_pb2.GenerateResponse]:
    """Resolves the entry's adapter and streams it (`adapter_entry_stream`).

    When the gateway's answer for the adapter is no longer fresh but one is known (a warm adapter used
    more than the resolve TTL ago), the entry starts on compute at that version at once while the host
    cache confirms it; its first message leaves only once the answer is in. The same answer: the stream
    goes on, and the cache's round trip overlapped the prefill instead of preceding it. Another version:
    the started request is cancelled on compute (its KV blocks and adapter pin freed) and the entry starts
    again at the version the cache named, so no token of a version the cache no longer names is sent. An
    error (say, the adapter was removed): the started request is cancelled and the error is the entry's."""
    guess = resolver.last_known(entry.spec)
    if guess is None:
        lora = await resolver.resolve(entry.spec, entry.what)
        async for msg in adapter_entry_stream(entry, lora, resolver, router, codec):
            yield msg
        return
    confirm = asyncio.ensure_future(resolver.resolve(entry.spec, entry.what))
    stream = adapter_entry_stream(entry, guess, resolver, router, codec)
    try:
        try:
            first = await anext(stream)
        except StopAsyncIteration:
            first = None
        except Exception:
            if await confirm == guess:
                raise
            first = None                     # the guess was stale: start over at the confirmed version
        lora = await confirm
        if lora == guess:
            if first is not None:
                yield first
                async for msg in stream:
                    yield msg
            return
    finally:
        await stream.aclose()                # cancels the compute request if it is still open
        if not confirm.done():
            confirm.cancel()
        elif not confirm.cancelled():
            confirm.exception()              # retrieved: the caller may have gone before it was awaited
    log.info("%s: the host cache names version %s, not %s: started again", entry.what, lora.version,
             guess.version)
    async for msg in adapter_entry_stream(entry, lora, resolver, router, codec):
        yield msg


EntryFactory = Callable[[], Awaitable[AsyncIterator[gateway_pb2.GenerateResponse]]]


def error_response(index: int, exc: BaseException, task_id: int | None = None) -> gateway_pb2.GenerateResponse:
    """The last message of an entry that failed: finish_reason ERROR and why."""
    code = getattr(exc, "grpc_code", None)
    prefix = f"{code.name}: " if isinstance(code, grpc.StatusCode) else "INTERNAL: "
    msg = gateway_pb2.GenerateResponse(index=index, finish_reason=common_pb2.ERROR, error=prefix + str(exc))
    if task_id is not None:
        msg.task_id, msg.has_task_id = task_id, True
    return msg


async def merge_entries(entries: Sequence[tuple[int, EntryFactory, int | None]]
                        ) -> AsyncIterator[gateway_pb2.GenerateResponse]:
    """Runs entries concurrently; yields their messages as they come.

    `entries` holds (index, factory, task id if known); a factory resolves the
    entry's adapter and returns its stream. A failing entry yields an ERROR
    message; cancelling this generator cancels every entry (and so its compute call).
    The queue holds a few messages per entry: an entry whose messages the
    caller has not taken waits, so its tokens gather in its own bounded buffer
    (`token_stream.RequestStream`: coalesced, and a client that stops reading a
    fan-out is cut off as one that stops reading a single stream is).
    """
    queue: asyncio.Queue[gateway_pb2.GenerateResponse | None] = asyncio.Queue(maxsize=4 * len(entries))

    async def pump(index: int, factory: EntryFactory, task_id: int | None) -> None:
        try:
            stream = await factory()
            async for item in stream:
                await queue.put(item)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - this entry fails alone
            if getattr(exc, "grpc_code", None) is None:
                log.exception("entry %d failed", index)
            await queue.put(error_response(index, exc, task_id))
        await queue.put(None)       # not in a finally: a cancelled pump's reader is gone

    tasks = [asyncio.create_task(pump(i, f, t)) for i, f, t in entries]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is None:
                remaining -= 1
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


@dataclass(frozen=True)
class Entry:
    """One entry of a call: its job, the adapter it names, and how messages name that adapter."""

    job: EntryJob
    spec: common_pb2.LoraSpec
    what: str                   # e.g. "lora", "loras[2]" or "model": the prefix of its error messages


async def run_entries(entries: Sequence[Entry], resolver: AdapterResolver, router: ComputeRouter,
                      codec: PromptCodec, *, resolve_first: bool = False
                      ) -> AsyncIterator[gateway_pb2.GenerateResponse]:
    """Streams a call's entries. One entry: its failures raise (they are the call's status). Several:
    they run concurrently, each resolving its adapter as it starts, and a failing one ends alone with
    ERROR; with `resolve_first`, every distinct adapter is resolved before any entry starts, so an
    unknown one fails the whole call instead (the HTTP API answers one status per request)."""
    if len(entries) == 1:
        async for msg in resolved_entry_stream(entries[0], resolver, router, codec):
            yield msg
        return
    resolved: dict[bytes, ResolvedLora] = {}
    if resolve_first:
        for e in entries:
            key = e.spec.SerializeToString(deterministic=True)
            if key not in resolved:
                resolved[key] = await resolver.resolve(e.spec, e.what)

    def factory(entry: Entry) -> EntryFactory:
        async def start() -> AsyncIterator[gateway_pb2.GenerateResponse]:
            if not resolved:
                return resolved_entry_stream(entry, resolver, router, codec)
            lora = resolved[entry.spec.SerializeToString(deterministic=True)]
            return adapter_entry_stream(entry, lora, resolver, router, codec)
        return start

    known = [(e.job.index, factory(e), e.spec.task_id if e.spec.HasField("task_id") else None) for e in entries]
    async for msg in merge_entries(known):
        yield msg
