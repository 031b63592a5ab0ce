"""`loraplex compute --engine-process on`: the engine in a child process, gRPC in the service's process.

Real processes on the CPU: many multiplexed streams give the single-process
engine's tokens, a cancel frees the KV blocks in the engine process, stats and
model info cross the pipe, a killed engine process turns into UNAVAILABLE (no
hang), and SIGTERM stops both processes.
"""
from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import grpc
import pytest

from compute_service.build import zero_kv_cache
from compute_service.engine.config import EngineConfig
from compute_service.engine.llm_engine import LLMEngine
from compute_service.engine.loader import load_model
from compute_service.engine.sampling_params import SamplingParams
from loraplex.procs import start_service
from loraplex.v1 import common_pb2, compute_pb2, compute_pb2_grpc

pytestmark = [pytest.mark.serial, pytest.mark.slow]
FLAGS = ["--max-model-len", "96", "--kv-cache-bytes", str(1 << 20), "--lora-gpu-cache-bytes", str(4 << 20),
         "--max-lora-rank", "64", "--max-num-seqs", "32", "--engine-process", "on"]


@pytest.fixture
def services(tiny_model_dir):
    cache = start_service("cache", ["cache", "--listen", "127.0.0.1:0", "--model", str(tiny_model_dir)])
    compute = None
    try:
        compute = start_service("compute", ["compute", "--listen", "127.0.0.1:0", "--cache-address", cache.address,
                                            "--model", str(tiny_model_dir), *FLAGS])
        yield cache, compute
    finally:
        for svc in (compute, cache):
            if svc is not None:
                svc.stop()


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in path.read_text().split()] if path.exists() else []


def _engine_pid(compute) -> int:
    for child in _children(compute.proc.pid):
        cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
        if b"multiprocessing" in cmdline and b"spawn" in cmdline:
            return child
    raise AssertionError(f"no engine process under {compute.proc.pid}: {_children(compute.proc.pid)}")


def _request(rid: str, prompt: list[int], max_tokens: int) -> compute_pb2.GenerateTokensRequest:
    return compute_pb2.GenerateTokensRequest(
        request_id=rid, input_ids=prompt,
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def _reference(tiny_model_dir, prompts, max_tokens):
    ref = LLMEngine(EngineConfig(model=str(tiny_model_dir), max_model_len=96, kv_cache_bytes=1 << 20,
                                 lora_backend="torch"), load_model(tiny_model_dir))
    zero_kv_cache(ref)
    return ref.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))


def test_streams_match_the_engine_and_cancel_frees_blocks(services, tiny_model_dir):
    _, compute = services
    prompts = [[3 + i, 7, 11 + i % 5] for i in range(24)]

    async def main():
        async with grpc.aio.insecure_channel(compute.address) as ch:
            stub = compute_pb2_grpc.ComputeStub(ch)

            async def one(i):
                return [t async for m in stub.GenerateTokens(_request(f"r{i}", prompts[i], 10)) for t in m.token_ids]
            outs = await asyncio.gather(*(one(i) for i in range(len(prompts))))
            # A stream on StreamTokens, cancelled after its first tokens.
            call = stub.StreamTokens()
            await call.write(compute_pb2.StreamTokensRequest(start=[compute_pb2.StartTokens(
                handle=1, request=_request("long", [5, 6, 7], 80))]))
            first = await call.read()
            busy = await stub.GetStats(compute_pb2.GetStatsRequest())
            await call.write(compute_pb2.StreamTokensRequest(cancel=[1]))
            await call.done_writing()
            while await call.read() is not grpc.aio.EOF:
                pass
            deadline = time.monotonic() + 10
            while True:
                stats = await stub.GetStats(compute_pb2.GetStatsRequest())
                if stats.kv_blocks_used == 0 or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.05)
            info = await stub.GetModelInfo(compute_pb2.ComputeModelInfoRequest())
            return outs, first, busy, stats, info

    outs, first, busy, stats, info = asyncio.run(main())
    assert outs == _reference(tiny_model_dir, prompts, 10)
    assert set(first.handles) == {1} and len(first.token_ids) >= 1
    assert busy.kv_blocks_used > 0
    assert stats.kv_blocks_used == 0 and stats.num_running == 0
    assert info.model.max_model_len == 96 and info.model.max_lora_rank == 64 and info.model.device == "cpu"


def test_a_killed_engine_process_is_unavailable_not_a_hang(services):
    _, compute = services
    engine_pid = _engine_pid(compute)

    async def main():
        async with grpc.aio.insecure_channel(compute.address) as ch:
            stub = compute_pb2_grpc.ComputeStub(ch)
            call = stub.GenerateTokens(_request("slow", [5, 6, 7], 90))
            await call.read()
            os.kill(engine_pid, signal.SIGKILL)
            with pytest.raises(grpc.aio.AioRpcError) as during:
                while await call.read() is not grpc.aio.EOF:
                    pass
            with pytest.raises(grpc.aio.AioRpcError) as after:
                async for _ in stub.GenerateTokens(_request("next", [1, 2], 4)):
                    pass
            with pytest.raises(grpc.aio.AioRpcError) as stats:
                await stub.GetStats(compute_pb2.GetStatsRequest())
            return during.value, after.value, stats.value

    during, after, stats = asyncio.run(asyncio.wait_for(main(), 60))
    for err in (during, after, stats):
        assert err.code() == grpc.StatusCode.UNAVAILABLE, err
        assert "engine process stopped" in err.details()
    # The service's log reaches this process through a reader thread, possibly after the calls' errors.
    deadline = time.monotonic() + 10
    while "the engine process stopped" not in compute.output() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "the engine process stopped" in compute.output()


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def test_sigterm_stops_both_processes(services):
    _, compute = services
    engine_pid = _engine_pid(compute)
    assert compute.stop() == 0, compute.output()
    assert "compute_service stopped" in compute.output()
    deadline = time.monotonic() + 10
    while _alive(engine_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(engine_pid), "the engine process outlived the compute service"
