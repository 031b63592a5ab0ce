"""A gateway over two CPU compute replicas, all real processes: affinity, spreading, spill, failover.

The cache, two compute services (SmolLM2 on the CPU) and a gateway run as
`loraplex` processes. What each replica did is read from the replica itself:
its GPU-cache residency (`GetStats.resident_task_ids`) and its Prometheus
token counter. The failover test kills both replicas, so it runs last.
"""
from __future__ import annotations

import re
import socket
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
import numpy as np
import pytest

from loraplex.procs import ServiceProcess, start_service
from loraplex.v1 import common_pb2, compute_pb2, compute_pb2_grpc, gateway_pb2, gateway_pb2_grpc
from gateway.replicas import rendezvous_order

pytestmark = [pytest.mark.serial, pytest.mark.slow, pytest.mark.timeout(900)]

HIDDEN = 576  # SmolLM2-135M: attn_q is 576 -> 576
RANK = 4
TASK_IDS = (101, 102, 103, 104)
SPILL_TASK_ID = 201
SPILL_THRESHOLD = 2  # in-flight requests on an adapter's home before new ones spill


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Replica:
    def __init__(self, svc: ServiceProcess, metrics_port: int) -> None:
        self.svc = svc
        self.metrics_port = metrics_port
        self.channel = grpc.insecure_channel(svc.address)
        self.stub = compute_pb2_grpc.ComputeStub(self.channel)

    @property
    def address(self) -> str:
        return self.svc.address

    def resident(self) -> set[int]:
        return set(self.stub.GetStats(compute_pb2.GetStatsRequest(), timeout=30).resident_task_ids)

    def num_running(self) -> int:
        stats = self.stub.GetStats(compute_pb2.GetStatsRequest(), timeout=30)
        return stats.num_running + stats.num_waiting

    def tokens_generated(self) -> float:
        """Tokens this replica has sampled so far (its step histogram's sum)."""
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=30).read().decode()
        m = re.search(r"^loraplex_compute_tokens_per_step_sum (\S+)$", text, re.M)
        assert m, text
        return float(m.group(1))


@dataclass
class System:
    stub: gateway_pb2_grpc.GatewayStub
    replicas: list[Replica]
    gateway: ServiceProcess
    started_at: float  # time.time() when the gateway was listening


@pytest.fixture(scope="module")
def system():
    procs: list[ServiceProcess] = []
    try:
        cache = start_service("cache", ["cache", "--listen", "127.0.0.1:0"], timeout_s=300)
        procs.append(cache)

        def compute(i: int) -> tuple[ServiceProcess, int]:
            port = free_port()
            svc = start_service(f"compute-{i}", [
                "compute", "--listen", "127.0.0.1:0", "--cache-address", cache.address, "--device", "cpu",
                "--max-num-seqs", "8", "--max-model-len", "1024", "--kv-cache-bytes", str(64 << 20),
                "--metrics-port", str(port)], timeout_s=300)
            return svc, port

        with ThreadPoolExecutor(2) as pool:
            started = list(pool.map(compute, range(2)))
        procs += [svc for svc, _ in started]
        replicas = [Replica(svc, port) for svc, port in started]
        # Health checks far apart: the failover test shows that requests fail over by
        # themselves, before any health check could notice a dead replica.
        gateway = start_service("gateway", [
            "gateway", "--listen", "127.0.0.1:0", "--cache-address", cache.address,
            "--compute-addresses", ",".join(r.address for r in replicas),
            "--replica-health-interval-s", "600", "--replica-spill-threshold", str(SPILL_THRESHOLD)],
            timeout_s=300)
        procs.append(gateway)
        channel = grpc.insecure_channel(gateway.address)
        yield System(gateway_pb2_grpc.GatewayStub(channel), replicas, gateway, time.time())
        channel.close()
    finally:
        for svc in reversed(procs):
            svc.stop()


def adapter_spec(task_id: int, with_weights: bool) -> common_pb2.LoraSpec:
    """A rank-4 attn_q adapter on layer 0, random per task id, inline the first time."""
    spec = common_pb2.LoraSpec(task_id=task_id)
    if with_weights:
        rng = np.random.default_rng(task_id)
        weights = (rng.standard_normal((1, RANK * 2 * HIDDEN)) * 0.02).astype(np.float32)
        config = np.array([[1, 0, RANK]], dtype=np.int32)
        spec.weights.CopyFrom(common_pb2.Tensor(dtype=common_pb2.FLOAT32, shape=list(weights.shape),
                                                data=weights.tobytes()))
        spec.config.CopyFrom(common_pb2.Tensor(dtype=common_pb2.INT32, shape=list(config.shape),
                                               data=config.tobytes()))
    return spec


def generate(stub, lora: common_pb2.LoraSpec | None = None, max_tokens: int = 3, timeout: float = 120):
    """Runs one Generate to its end; returns its messages."""
    req = gateway_pb2.GenerateRequest(text="The capital of France is",
                                      sampling=common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    if lora is not None:
        req.loras.append(lora)
    msgs = list(stub.Generate(req, timeout=timeout))
    assert msgs[-1].finish_reason == common_pb2.LENGTH, msgs[-1]
    assert sum(len(m.token_ids) for m in msgs) == max_tokens
    return msgs


def test_repeated_adapter_stays_on_its_home_replica(system):
    stub, replicas = system.stub, system.replicas
    for task_id in TASK_IDS:
        generate(stub, adapter_spec(task_id, with_weights=True))
        for _ in range(3):
            generate(stub, adapter_spec(task_id, with_weights=False))
    addresses = [r.address for r in replicas]
    resident = {r.address: r.resident() & set(TASK_IDS) for r in replicas}
    for task_id in TASK_IDS:
        home = rendezvous_order(str(task_id), addresses)[0]
        holders = [a for a, ids in resident.items() if task_id in ids]
        assert holders == [home], f"adapter {task_id}: on {holders}, home {home}; residency {resident}"


def test_base_requests_spread_over_replicas(system):
    stub, replicas = system.stub, system.replicas
    before = [r.tokens_generated() for r in replicas]
    for _ in range(6):
        generate(stub, max_tokens=3)
    served = [(r.tokens_generated() - b) / 3 for r, b in zip(replicas, before)]
    assert sum(served) == 6
    assert min(served) >= 2, f"base requests per replica: {served}"


def test_saturated_home_spills_to_the_other_replica(system):
    stub, replicas = system.stub, system.replicas
    addresses = [r.address for r in replicas]
    home = rendezvous_order(str(SPILL_TASK_ID), addresses)[0]
    generate(stub, adapter_spec(SPILL_TASK_ID, with_weights=True))
    assert [r.address for r in replicas if SPILL_TASK_ID in r.resident()] == [home]
    # three at once: two fill the home up to the threshold, the third spills
    with ThreadPoolExecutor(SPILL_THRESHOLD + 1) as pool:
        list(pool.map(lambda _: generate(stub, adapter_spec(SPILL_TASK_ID, with_weights=False), max_tokens=48),
                      range(SPILL_THRESHOLD + 1)))
    assert all(SPILL_TASK_ID in r.resident() for r in replicas), "the spilled request ran on the other replica"


def test_failover_when_a_replica_is_killed(system):
    stub, replicas, gateway = system.stub, system.replicas, system.gateway
    addresses = [r.address for r in replicas]
    # kill the first replica (the gateway asks it first for anything) while it is idle,
    # then use adapters homed on it: the gateway has not seen it die
    victim, survivor = replicas
    task_ids = [t for t in range(101, 200) if rendezvous_order(str(t), addresses)[0] == victim.address][:2]
    # the gateway's health round at start is over (it runs as the gateway starts listening;
    # the next is 600 s away), so nothing but a request can find the victim dead
    time.sleep(max(0.0, system.started_at + 2.0 - time.time()))
    victim.svc.proc.kill()
    victim.svc.proc.wait(30)
    # requests that have not started are retried on the survivor: every one succeeds
    # (weights ride along so this test also runs alone; AUTO uses the cached copy)
    for task_id in task_ids + list(TASK_IDS):
        generate(stub, adapter_spec(task_id, with_weights=True))
    for _ in range(4):
        generate(stub)
    assert set(task_ids + list(TASK_IDS)) <= survivor.resident(), "every adapter now runs on the survivor"
    assert f"{victim.address} failed" in gateway.output(), "the first request was retried"

    # a stream that has sent tokens ends with UNAVAILABLE when its replica dies
    stream = stub.Generate(gateway_pb2.GenerateRequest(
        text="Tell me a long story.", sampling=common_pb2.SamplingParams(max_tokens=900, ignore_eos=True)),
        timeout=300)
    assert next(stream).token_ids
    assert survivor.num_running() == 1
    survivor.svc.proc.kill()
    with pytest.raises(grpc.RpcError) as info:
        for _ in stream:
            pass
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value.details()
    assert survivor.address in info.value.details() and "send it again" in info.value.details()

    # with no replica left, a request says which replicas it tried and why
    with pytest.raises(grpc.RpcError) as info:
        generate(stub)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert victim.address in info.value.details() and survivor.address in info.value.details()
