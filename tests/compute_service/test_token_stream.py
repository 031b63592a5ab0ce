"""Compute.StreamTokens on a real aio server: many requests per call, one message per step batch.

Checks what a gateway relies on: every delta arrives in order with nothing lost
or duplicated (against what the engine itself emitted, step by step), a
cancelled request or a broken call frees KV blocks and adapter pins, and one
request's error or deadline never disturbs the others on the same call.
"""
from __future__ import annotations

import asyncio
import collections
import random

import grpc
import pytest
from compute_helpers import random_adapter
from test_compute_grpc import _close, _serve, _wait_idle, slow_steps
from test_runner_workload import make_runtime

from compute_service.adapter_cache.loader import adapter_key
from loraplex.v1 import common_pb2, compute_pb2

pytestmark = pytest.mark.serial


def start(handle, prompt, max_tokens, task_id=None, timeout_s=0.0, rid=None):
    req = compute_pb2.GenerateTokensRequest(request_id=rid or f"h{handle}", input_ids=prompt,
                                            sampling=common_pb2.SamplingParams(max_tokens=max_tokens,
                                                                               ignore_eos=True))
    if task_id is not None:
        req.adapter.task_id = task_id
    return compute_pb2.StartTokens(handle=handle, request=req, timeout_s=timeout_s)


class Reader:
    """Reads a StreamTokens call: tokens per handle, how each ended, and how many messages came."""

    def __init__(self, call):
        self.call = call
        self.tokens = collections.defaultdict(list)
        self.finished = {}
        self.errors = {}
        self.num_messages = 0

    def ended(self, handle):
        return handle in self.finished or handle in self.errors

    async def until(self, done, timeout=30.0):
        async def loop():
            while not done(self):
                msg = await self.call.read()
                assert msg is not grpc.aio.EOF, "the call ended early"
                self.num_messages += 1
                assert len(msg.handles) == len(msg.num_tokens) and sum(msg.num_tokens) == len(msg.token_ids)
                pos = 0
                for h, n in zip(msg.handles, msg.num_tokens):
                    assert not self.ended(h), f"tokens for handle {h} after its end"
                    self.tokens[h] += msg.token_ids[pos:pos + n]
                    pos += n
                for f in msg.finished:
                    assert not self.ended(f.handle)
                    self.finished[f.handle] = f
                for e in msg.errors:
                    assert not self.ended(e.handle)
                    self.errors[e.handle] = e
        await asyncio.wait_for(loop(), timeout)


def record_engine_deltas(rt):
    """What the engine emitted per request id, in step order (the step runs on the engine thread): the
    step's outputs and its routed sequences' one new token each."""
    emitted = collections.defaultdict(list)
    real_step = rt.engine.step

    def step():
        outs = real_step()
        for out in outs:
            emitted[out.request_id] += out.new_token_ids
        for seq in rt.engine.routed:
            emitted[seq.request_id].append(seq.token_ids[-1])
        emitted[IN_FLIGHT].append(int(rt.engine.in_flight))
        return outs
    rt.engine.step = step
    return emitted


IN_FLIGHT = "(steps that ended with a step in flight)"


@pytest.mark.parametrize("steps", ["plain", "overlapped"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_256_streams_on_one_call_arrive_in_order_nothing_lost_or_duplicated(request, tiny_model_dir, device, steps):
    """On CUDA the engine thread replays decode CUDA graphs and loads adapters on the side stream;
    "overlapped": --async-scheduling."""
    loaded = request.getfixturevalue("loaded" if device == "cpu" else "loaded_cuda")
    adapters = {t: random_adapter(loaded.spec, 4, seed=300 + t) for t in (1, 2, 3)}
    rt = make_runtime(loaded, tiny_model_dir, adapters, 2 << 20, device=device,
                      async_scheduling=steps == "overlapped")
    emitted = record_engine_deltas(rt)
    gen = random.Random(7)
    specs = {h: ([gen.randrange(96) for _ in range(gen.randrange(2, 8))], gen.randrange(3, 12),
                 gen.choice([None, 1, 2, 3])) for h in range(1, 257)}

    async def main():
        server, channel, stub = await _serve(rt)
        try:
            call = stub.StreamTokens()
            reader = Reader(call)
            handles = list(specs)
            for i in range(0, len(handles), 64):       # starts arrive in a few batches
                await call.write(compute_pb2.StreamTokensRequest(
                    start=[start(h, *specs[h]) for h in handles[i:i + 64]]))
            await reader.until(lambda r: all(r.ended(h) for h in specs), timeout=120)
            stats = await _wait_idle(stub)
            await call.done_writing()
            return reader, stats
        finally:
            await _close(rt, server, channel)

    reader, stats = asyncio.run(main())
    assert not reader.errors
    assert (sum(emitted.pop(IN_FLIGHT)) > 10) == (steps == "overlapped")
    for h, (prompt, max_tokens, _) in specs.items():
        rid = next(r for r in emitted if r.endswith(f".{h}"))
        assert reader.tokens[h] == emitted[rid], f"handle {h}: stream differs from what the engine emitted"
        assert len(reader.tokens[h]) == max_tokens
        f = reader.finished[h]
        assert f.finish_reason == common_pb2.LENGTH and f.usage.completion_tokens == max_tokens
        assert f.usage.prompt_tokens == len(prompt)
    # one message carries many requests' deltas: far fewer messages than deltas
    assert reader.num_messages < sum(len(t) for t in reader.tokens.values()) / 4
    assert stats.kv_blocks_used == 0


@pytest.mark.parametrize("steps", ["plain", "overlapped"])
def test_cancel_and_broken_call_free_kv_blocks_and_adapter_pins(loaded, tiny_model_dir, steps):
    adapters = {8: random_adapter(loaded.spec, 8, seed=81), 9: random_adapter(loaded.spec, 8, seed=91)}
    rt = make_runtime(loaded, tiny_model_dir, adapters, 2 << 20, async_scheduling=steps == "overlapped")
    slow_steps(rt, 0.01)   # a slow model, so the requests are surely mid-way

    async def main():
        server, channel, stub = await _serve(rt)
        try:
            call = stub.StreamTokens()
            reader = Reader(call)
            await call.write(compute_pb2.StreamTokensRequest(start=[start(1, [1, 2, 3], 80, 8),
                                                                    start(2, [4, 5], 6, 9)]))
            await reader.until(lambda r: len(r.tokens[1]) >= 3)
            await call.write(compute_pb2.StreamTokensRequest(cancel=[1]))
            await reader.until(lambda r: r.ended(2))
            cancelled = await _wait_idle(stub, timeout=1.0)   # far sooner than the ~0.8 s the rest would take
            pins_after_cancel = rt.slots.residency.get(adapter_key(8, "")).pins
            # a second call breaks (its client goes away) with a request mid-way
            broken = stub.StreamTokens()
            await broken.write(compute_pb2.StreamTokensRequest(start=[start(1, [1, 2], 80, 9)]))
            await Reader(broken).until(lambda r: len(r.tokens[1]) >= 2)
            broken.cancel()
            after_break = await _wait_idle(stub, timeout=1.0)
            return reader, cancelled, pins_after_cancel, after_break
        finally:
            await _close(rt, server, channel)

    reader, cancelled, pins_after_cancel, after_break = asyncio.run(main())
    assert 3 <= len(reader.tokens[1]) < 80 and 1 not in reader.finished   # a cancelled handle hears nothing more
    assert reader.finished[2].finish_reason == common_pb2.LENGTH and len(reader.tokens[2]) == 6
    assert cancelled.kv_blocks_used == 0 and cancelled.num_running == 0 and pins_after_cancel == 0
    assert after_break.kv_blocks_used == 0 and after_break.num_running == 0
    for key in (adapter_key(8, ""), adapter_key(9, "")):
        entry = rt.slots.residency.get(key)
        assert entry.pins == 0 and entry.wants == 0 and entry.idle


def test_one_bad_request_or_deadline_never_disturbs_the_others(loaded, tiny_model_dir):
    adapters = {4: random_adapter(loaded.spec, 8, seed=4)}
    rt = make_runtime(loaded, tiny_model_dir, adapters, 2 << 20)
    slow_steps(rt, 0.005)

    async def fetch(task_id, version):
        from loraplex.errors import NotFoundError
        if task_id not in adapters:
            raise NotFoundError(f"task id {task_id} is not in the host cache")
        return adapters[task_id]
    rt.runner.fetch = fetch

    async def main():
        server, channel, stub = await _serve(rt)
        try:
            call = stub.StreamTokens()
            reader = Reader(call)
            bad_sampling = start(3, [1, 2], 4)
            bad_sampling.request.sampling.temperature = -1.0
            await call.write(compute_pb2.StreamTokensRequest(start=[
                start(1, [1, 2, 3], 20, 4), start(2, [5, 6], 4, 404), bad_sampling,
                start(4, [7] * 200, 4),                          # prompt longer than max_model_len
                start(5, [1, 2], 90, None, timeout_s=0.15),      # deadline passes mid-way
                start(6, [3, 4], 12)]))
            await reader.until(lambda r: all(r.ended(h) for h in range(1, 7)))
            stats = await _wait_idle(stub)
            return reader, stats
        finally:
            await _close(rt, server, channel)

    reader, stats = asyncio.run(main())
    codes = {h: grpc.StatusCode(next(c for c in grpc.StatusCode if c.value[0] == e.code))
             for h, e in reader.errors.items()}
    assert codes == {2: grpc.StatusCode.NOT_FOUND, 3: grpc.StatusCode.INVALID_ARGUMENT,
                     4: grpc.StatusCode.INVALID_ARGUMENT, 5: grpc.StatusCode.DEADLINE_EXCEEDED}
    assert "404" in reader.errors[2].message and "temperature" in reader.errors[3].message
    assert all(len(e.message) <= 512 for e in reader.errors.values())
    assert 0 < len(reader.tokens[5]) < 90
    assert len(reader.tokens[1]) == 20 and reader.finished[1].finish_reason == common_pb2.LENGTH
    assert len(reader.tokens[6]) == 12
    assert stats.kv_blocks_used == 0 and stats.num_running == 0
