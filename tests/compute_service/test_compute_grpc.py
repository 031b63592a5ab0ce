"""The Compute gRPC API on a real aio server (port 0): streaming, cancel, deadline, refusal, stats, model info."""
from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from compute_helpers import random_adapter
from test_runner_workload import make_runtime, reference_engine

from compute_service.adapter_cache.loader import adapter_key
from compute_service.engine.sampling_params import SamplingParams
from compute_service.servicer import ComputeServicer
from loraplex import errors
from loraplex.formats import ModelSpec
from loraplex.v1 import common_pb2, compute_pb2, compute_pb2_grpc

pytestmark = pytest.mark.serial


async def _serve(rt):
    server = grpc.aio.server()
    compute_pb2_grpc.add_ComputeServicer_to_server(ComputeServicer(rt, 96), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    rt.runner.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    return server, channel, compute_pb2_grpc.ComputeStub(channel)


async def _close(rt, server, channel):
    await channel.close()
    await server.stop(0)
    await rt.runner.stop()


def slow_steps(rt, seconds):
    """Makes every engine step take at least `seconds` (it runs on the engine thread)."""
    real_step = rt.engine.step

    def step():
        time.sleep(seconds)
        return real_step()
    rt.engine.step = step


def _req(rid, prompt, max_tokens, task_id=None, **sampling):
    r = compute_pb2.GenerateTokensRequest(request_id=rid, input_ids=prompt,
                                          sampling=common_pb2.SamplingParams(max_tokens=max_tokens, **sampling))
    if task_id is not None:
        r.adapter.task_id = task_id
    return r


async def _wait_idle(stub, timeout=10.0):
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        s = await stub.GetStats(compute_pb2.GetStatsRequest())
        if s.num_running == 0 and s.num_waiting == 0 and s.kv_blocks_used == 0:
            return s
        assert asyncio.get_running_loop().time() < deadline, f"not idle: {s}"
        await asyncio.sleep(0.01)


def test_stream_equals_engine_and_stats_and_model_info(loaded, tiny_model_dir):
    adapters = {5: random_adapter(loaded.spec, 8, seed=55)}
    rt = make_runtime(loaded, tiny_model_dir, adapters, 2 << 20)
    ref = reference_engine(loaded, tiny_model_dir, adapters)
    prompt = [3, 14, 15, 92, 65]

    async def main():
        server, channel, stub = await _serve(rt)
        try:
            outs = {}
            for tid in (None, 5):
                msgs = [m async for m in stub.GenerateTokens(_req(f"s{tid}", prompt, 7, tid, ignore_eos=True))]
                outs[tid] = msgs
            info = (await stub.GetModelInfo(compute_pb2.ComputeModelInfoRequest())).model
            stats = await _wait_idle(stub)
            return outs, info, stats
        finally:
            await _close(rt, server, channel)

    outs, info, stats = asyncio.run(main())
    for tid, msgs in outs.items():
        toks = [t for m in msgs for t in m.token_ids]
        want = ref.generate([prompt], SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True),
                            [None if tid is None else adapter_key(tid, "")])[0]
        assert toks == want
        assert msgs[-1].finish_reason == common_pb2.LENGTH and msgs[-1].usage.completion_tokens == 7
        assert msgs[-1].usage.prompt_tokens == len(prompt)
        assert all(m.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED for m in msgs[:-1])
    assert info.num_layers == loaded.spec.num_layers and info.hidden_size == 64 and info.vocab_size == 96
    assert info.max_lora_rank == 64 and info.device == "cpu"
    assert info.weights == "float32"            # a dense checkpoint: its dtype
    # The fingerprint adapters are checked against: the one the host cache computes from the same files.
    assert info.fingerprint == ModelSpec.from_path(tiny_model_dir).fingerprint
    assert list(stats.resident_task_ids) == [5] and stats.adapter_pages_used > 0
    assert stats.adapter_pool_bytes_used == stats.adapter_pages_used * rt.slots.layout.page_bytes


@pytest.mark.parametrize("how", ["cancel", "deadline"])
def test_cancel_or_deadline_mid_stream_frees_everything(loaded, tiny_model_dir, how):
    adapters = {8: random_adapter(loaded.spec, 16, seed=88)}
    rt = make_runtime(loaded, tiny_model_dir, adapters, 2 << 20)
    slow_steps(rt, 0.01)   # a slow model, so the stream is surely mid-way when the client gives up

    async def main():
        server, channel, stub = await _serve(rt)
        try:
            timeout = 0.4 if how == "deadline" else None
            call = stub.GenerateTokens(_req("long", [1, 2, 3], 90, 8, ignore_eos=True), timeout=timeout)
            got = 0
            # A local cancel ends the iteration with CancelledError; a deadline with DEADLINE_EXCEEDED.
            with pytest.raises(asyncio.CancelledError if how == "cancel" else grpc.aio.AioRpcError) as err:
                async for m in call:
                    got += len(m.token_ids)
                    if got >= 3 and how == "cancel":
                        call.cancel()
            if how == "deadline":
                assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert 3 <= got < 90
            stats = await _wait_idle(stub, timeout=0.3)   # far sooner than the ~0.9 s the rest would take
            entry = rt.slots.residency.get(adapter_key(8, ""))
            return stats, entry
        finally:
            await _close(rt, server, channel)

    stats, entry = asyncio.run(main())
    assert stats.kv_blocks_used == 0 and stats.num_running == 0
    assert entry.pins == 0 and entry.wants == 0 and entry.idle


def test_adapter_larger_than_pool_refused_with_size_and_capacity(loaded, tiny_model_dir):
    adapters = {1: random_adapter(loaded.spec, 64, seed=1)}
    rt = make_runtime(loaded, tiny_model_dir, adapters, 64 << 10)

    async def main():
        server, channel, stub = await _serve(rt)
        try:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in stub.GenerateTokens(_req("big", [1, 2], 4, 1)):
                    pass
            # the service is still fine for the base model afterwards
            ok = [m async for m in stub.GenerateTokens(_req("base", [1, 2], 3, None, ignore_eos=True))]
            return err.value, ok
        finally:
            await _close(rt, server, channel)

    err, ok = asyncio.run(main())
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "needs" in err.details() and f"holds {rt.slots.layout.num_pages} pages" in err.details()
    assert sum(len(m.token_ids) for m in ok) == 3


def test_unknown_adapter_not_found_and_prefetch_drop(loaded, tiny_model_dir):
    adapters = {2: random_adapter(loaded.spec, 8, seed=2)}
    rt = make_runtime(loaded, tiny_model_dir, adapters, 2 << 20)

    async def fetch(task_id, version):
        if task_id not in adapters:
            raise errors.NotFoundError(f"task id {task_id} is not in the host cache")
        return adapters[task_id]
    rt.runner.fetch = fetch

    async def main():
        server, channel, stub = await _serve(rt)
        try:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in stub.GenerateTokens(_req("missing", [1, 2], 4, 404)):
                    pass
            pre = compute_pb2.PrefetchAdapterRequest(adapter=compute_pb2.AdapterRef(task_id=2))
            first = await stub.PrefetchAdapter(pre)
            for _ in range(200):
                if rt.slots.is_ready(adapter_key(2, "")):
                    break
                await asyncio.sleep(0.01)
            second = await stub.PrefetchAdapter(pre)
            dropped = await stub.DropAdapter(compute_pb2.DropAdapterRequest(task_id=2))
            again = await stub.DropAdapter(compute_pb2.DropAdapterRequest(task_id=2))
            stats = await stub.GetStats(compute_pb2.GetStatsRequest())
            return err.value, first, second, dropped, again, stats
        finally:
            await _close(rt, server, channel)

    err, first, second, dropped, again, stats = asyncio.run(main())
    assert err.code() == grpc.StatusCode.NOT_FOUND and "404" in err.details()
    assert not first.resident and second.resident
    assert dropped.dropped and not again.dropped
    assert stats.adapter_pages_used == 0 and list(stats.resident_task_ids) == []


def test_adapter_for_another_base_model_is_failed_precondition(loaded, tiny_model_dir):
    foreign = random_adapter(loaded.spec, 8, seed=31).with_metadata(fingerprint="0123456789abcdef")
    rt = make_runtime(loaded, tiny_model_dir, {31: foreign}, 2 << 20)

    async def main():
        server, channel, stub = await _serve(rt)
        try:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                async for _ in stub.GenerateTokens(_req("foreign", [3, 4, 5], 4, 31)):
                    pass
            return info.value, await _wait_idle(stub)
        finally:
            await _close(rt, server, channel)

    err, stats = asyncio.run(main())
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION, err.details()
    assert "0123456789abcdef" in err.details() and "same --model" in err.details()
    assert list(stats.resident_task_ids) == []
