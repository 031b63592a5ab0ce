"""The gateway's token stream against a real compute server (tiny random model, port 0, one process).

256 client streams through a real gateway get exactly what the engine emitted
for them; a reader that stops reading holds up nobody on the shared call and
its buffer stays bounded (its request is cancelled on compute past the bound,
with RESOURCE_EXHAUSTED); a compute server that goes away mid-stream ends
every request on the call with UNAVAILABLE naming the replica and frees them.
"""
from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import grpc
import pytest

from compute_service.build import build_runtime
from compute_service.config import ComputeConfig
from compute_service.servicer import ComputeServicer
from gateway.downstream import DownstreamError
from gateway.replica_router import ReplicaRouter
from gateway.token_stream import ReplicaSession
from loraplex.errors import ResourceExhaustedError
from loraplex.v1 import common_pb2, compute_pb2, compute_pb2_grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gateway"))
from gateway_harness import gateway_stack  # noqa: E402  (a gateway server over any compute address)
from helpers import save_tiny, tiny_model  # noqa: E402  (the engine tests' tiny-model builder)

pytestmark = [pytest.mark.serial, pytest.mark.timeout(120)]
STEP_S = 0.004   # each engine step takes at least this long, so requests are surely mid-way when checked


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_tiny(tiny_model("llama", seed=3), tmp_path_factory.mktemp("tiny") / "llama")


def runtime(model_dir: Path, step_s: float = STEP_S):
    async def fetch(task_id, version):
        raise AssertionError("no adapters here")
    cfg = ComputeConfig(model=str(model_dir), device="cpu", dtype="float32", max_lora_rank=16,
                        lora_gpu_cache_bytes=1 << 20, max_model_len=96, max_num_batched_tokens=128,
                        max_num_seqs=16, kv_cache_bytes=1 << 20)
    rt = build_runtime(cfg, fetch)
    real_step = rt.engine.step

    def step():
        time.sleep(step_s)
        outs = real_step()
        for out in outs:
            rt.emitted.setdefault(out.request_id, []).extend(out.new_token_ids)
        for seq in rt.engine.routed:            # one new token each, not made into outputs
            rt.emitted.setdefault(seq.request_id, []).append(seq.token_ids[-1])
        return outs
    rt.engine.step = step
    rt.emitted = {}     # request id -> every token the engine emitted for it, in step order
    return rt


async def serve(rt) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    compute_pb2_grpc.add_ComputeServicer_to_server(ComputeServicer(rt, 96), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    rt.runner.start()
    return server, f"127.0.0.1:{port}"


def request(rid: str, max_tokens: int, prompt=(1, 2, 3)) -> compute_pb2.GenerateTokensRequest:
    return compute_pb2.GenerateTokensRequest(request_id=rid, input_ids=list(prompt), sampling=common_pb2.SamplingParams(
        max_tokens=max_tokens, ignore_eos=True))


async def read_all(stream) -> tuple[list[int], int]:
    tokens, batches = [], 0
    while (batch := await stream.next()) is not None:
        tokens += batch.token_ids
        batches += 1
        if batch.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
            assert batch.finish_reason == common_pb2.LENGTH
    return tokens, batches


async def idle(rt, timeout_s: float = 2.0):
    deadline = time.monotonic() + timeout_s
    while True:
        eng, pool = await rt.runner.snapshot()
        if eng.num_running == 0 and eng.num_waiting == 0 and eng.num_kv_blocks_used == 0:
            return eng
        assert time.monotonic() < deadline, f"compute still busy: {eng}"
        await asyncio.sleep(0.01)


def test_256_client_streams_through_the_gateway_get_exactly_what_the_engine_emitted(model_dir):
    from loraplex.model_files import load_tokenizer

    rt = runtime(model_dir, step_s=0.0)
    lengths = {f"c{i}": 2 + i % 9 for i in range(256)}

    async def one(client, rid):
        chunks = [c async for c in client.stream([1 + int(rid[1:]) % 90, 7], max_tokens=lengths[rid],
                                                 ignore_eos=True, request_id=rid)]
        return [t for c in chunks for t in c.token_ids], chunks[-1]

    async def main():
        server, address = await serve(rt)
        try:
            async with gateway_stack(load_tokenizer(""), compute_address=address) as st:
                return await asyncio.gather(*[one(st.client, rid) for rid in lengths])
        finally:
            await server.stop(0)
            await rt.runner.stop()

    results = asyncio.run(main())
    by_rid = {rid.split("@", 1)[0]: toks for rid, toks in rt.emitted.items()}
    for rid, (tokens, last) in zip(lengths, results):
        assert tokens == by_rid[rid], f"{rid}: the client got other tokens than the engine emitted"
        assert len(tokens) == lengths[rid] == last.completion_tokens and last.finish_reason == "length"


def test_a_reader_that_stops_slows_no_one_and_stays_bounded(model_dir):
    rt = runtime(model_dir)

    async def others(session, tag):
        t0 = time.monotonic()
        outs = await asyncio.gather(*[read_all(session.start(request(f"{tag}{i}", 24, (i + 1, 5)), None))
                                      for i in range(6)])
        return time.monotonic() - t0, outs

    async def main():
        server, address = await serve(rt)
        session = ReplicaSession(address, max_buffered_tokens=16)
        try:
            alone_s, alone = await others(session, "alone")
            stalled = session.start(request("stalled", 90), None)    # never read while the others run
            with_stalled_s, beside = await others(session, "beside")
            await idle(rt)
            assert stalled.done()
            batch = await stalled.next()                  # what it buffered: one coalesced batch
            with pytest.raises(ResourceExhaustedError, match="16 per request"):
                await stalled.next()
            return alone_s, alone, with_stalled_s, beside, batch
        finally:
            await session.close()
            await server.stop(0)
            await rt.runner.stop()

    alone_s, alone, with_stalled_s, beside, batch = asyncio.run(main())
    assert [t for t, _ in beside] == [t for t, _ in alone], "the same prompts give the same tokens"
    assert all(len(t) == 24 for t, _ in beside)
    assert with_stalled_s < 1.5 * alone_s + 0.3, (alone_s, with_stalled_s)
    assert 16 < len(batch.token_ids) <= 16 + 16          # the bound, plus at most one step's worth


def test_compute_going_away_mid_stream_is_unavailable_naming_it_and_frees_all(model_dir):
    rt = runtime(model_dir)

    async def consume(router, rid, got):
        async with router.stream(None, request(rid, 90), 30) as stream:
            async for batch in stream:
                got.extend(batch.token_ids)

    async def main():
        server, address = await serve(rt)
        router = ReplicaRouter([address], 1 << 20, health_interval_s=60)
        got = {rid: [] for rid in ("a", "b", "c")}
        try:
            tasks = [asyncio.create_task(consume(router, rid, got[rid])) for rid in got]
            while min(len(v) for v in got.values()) < 3:
                await asyncio.sleep(0.01)
            await server.stop(0)            # the replica goes away with three requests mid-way
            results = await asyncio.gather(*tasks, return_exceptions=True)
            eng = await idle(rt)
            return address, results, got, eng, router.replicas()[0].num_in_flight
        finally:
            await router.close()
            await rt.runner.stop()

    address, results, got, eng, in_flight = asyncio.run(main())
    for r in results:
        assert isinstance(r, DownstreamError), r
        assert r.grpc_code == grpc.StatusCode.UNAVAILABLE and address in str(r)
    assert all(3 <= len(v) < 90 for v in got.values())
    assert eng.num_kv_blocks_used == 0 and in_flight == 0
