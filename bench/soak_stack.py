"""The system bench/soak.py and tests/reliability/ drive: real services, started one by one so each can be
killed, restarted and probed.

`make_model(dir)` writes a tiny random Llama (bench/serve_load_setup.py's "tiny" shape, byte-level
tokenizer) whose positions reach far enough for long streams; `write_adapters(root, model, n)` writes `n`
PEFT folders a000.. with factors large enough to change the tiny model's greedy output, so "equals the
request run alone" is a real check. `Stack.start(...)` runs a cache service (shm, or redis with a
private redis-server), N compute services on the CPU or GPU and a gateway as `loraplex` processes;
the cache and redis listen on fixed ports so a restart comes back where the others look for it.

`Stack.leaks()` reads, from the services themselves, what must be zero once nothing runs: per compute
replica its running and waiting sequences, KV blocks in use and adapter pins (`GetStats`), adapter
copies mapped from the host cache's shared memory whose segments are gone (`/proc/PID/maps`); in the
shm cache, segments held by readers and segments left in /dev/shm beyond the cached adapters.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import grpc  # noqa: E402

from loraplex.cli.serve_procs import RedisServer, free_port  # noqa: E402
from loraplex.procs import ServiceProcess, spawn_service, start_service, wait_listening, wait_serving  # noqa: E402
from loraplex.v1 import compute_pb2, compute_pb2_grpc  # noqa: E402
from cache_service.shm_segments import MAGIC  # noqa: E402
from cache_service.shm_spares import MAX_SPARES  # noqa: E402

MAX_POSITIONS = 16384   # the tiny model's positions: long enough for a stream that outgrows the gateway's buffer


def make_model(out: Path) -> Path:
    """The tiny random model with a byte-level tokenizer (kept if `out` has one)."""
    from serve_load_setup import make_random_model

    if not (out / "config.json").is_file():
        make_random_model(out, "tiny", dtype="float32")
        cfg = json.loads((out / "config.json").read_text())
        cfg["max_position_embeddings"] = MAX_POSITIONS
        (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def write_adapters(root: Path, model: Path, num: int, ranks: tuple[int, ...] = (4, 8), std: float = 0.3
                   ) -> list[str]:
    """`num` PEFT folders `a000`.. under `root` (ranks cycling); returns their names."""
    sys.path.insert(0, str(ROOT / "examples"))
    from make_demo_adapters import write_adapter  # the demo's PEFT writer, any base model

    from loraplex.formats import ModelSpec

    spec = ModelSpec.from_path(model)
    names = []
    for i in range(num):
        name = f"a{i:03d}"
        if not (root / name / "adapter_model.safetensors").is_file():
            write_adapter(root / name, spec, seed=2000 + i, rank=ranks[i % len(ranks)], std=std)
        names.append(name)
    return names


@dataclass
class Stack:
    """cache (+ redis) + compute replicas + gateway, each its own process."""

    model: Path
    lora_root: Path
    cache_args: list[str]
    cache: ServiceProcess
    computes: list[ServiceProcess]
    gateway: ServiceProcess
    redis: RedisServer | None = None
    metrics_ports: dict[str, int] = field(default_factory=dict)   # compute name -> its Prometheus port
    _channels: dict[str, grpc.Channel] = field(default_factory=dict)

    @property
    def address(self) -> str:
        return self.gateway.address

    @classmethod
    def start(cls, model: Path, lora_root: Path, *, num_computes: int = 1, backend: str = "shm",
              device: str = "cpu", compute_flags: tuple[str, ...] = (), gateway_flags: tuple[str, ...] = (),
              cache_flags: tuple[str, ...] = (), timeout_s: float = 300.0) -> "Stack":
        redis = RedisServer.start() if backend == "redis" else None
        # Every port is picked here, so the services start at once (none waits for another's address).
        cache_addr = f"127.0.0.1:{free_port()}"
        compute_addrs = [f"127.0.0.1:{free_port()}" for _ in range(num_computes)]
        cache_args = ["cache", "--listen", cache_addr, "--model", str(model), "--lora-root", str(lora_root),
                      "--backend", backend, *(["--redis-url", redis.url] if redis is not None else []), *cache_flags]
        specs = [("cache", cache_args)]
        metrics_ports = [free_port() for _ in compute_addrs]
        specs += [(f"compute-{i}", ["compute", "--listen", a, "--model", str(model), "--device", device,
                                    "--cache-address", cache_addr, "--metrics-port", str(port), *compute_flags])
                  for i, (a, port) in enumerate(zip(compute_addrs, metrics_ports))]
        specs.append(("gateway", ["gateway", "--listen", "127.0.0.1:0", "--model", str(model), "--cache-address",
                                  cache_addr, "--compute-addresses", ",".join(compute_addrs), *gateway_flags]))
        started: list[ServiceProcess] = []
        try:
            for name, argv in specs:
                started.append(spawn_service(name, argv))
            deadline = time.monotonic() + timeout_s
            for svc in started:
                wait_listening(svc, max(1.0, deadline - time.monotonic()))
            for svc in started:
                wait_serving(svc, deadline)
        except BaseException:
            for svc in reversed(started):
                svc.stop()
            if redis is not None:
                redis.stop()
            raise
        cache, *computes, gateway = started
        return cls(model, lora_root, cache_args, cache, computes, gateway, redis,
                   dict(zip((c.name for c in computes), metrics_ports)))

    def stop(self) -> None:
        for ch in self._channels.values():
            ch.close()
        for svc in (self.gateway, *self.computes, self.cache):
            svc.stop()
        if self.redis is not None:
            self.redis.stop()

    # -- faults ----------------------------------------------------------------------------------------
    def kill(self, svc: ServiceProcess) -> float:
        """SIGKILL; returns time.monotonic() right after the signal went out."""
        svc.proc.send_signal(signal.SIGKILL)
        at = time.monotonic()
        svc.proc.wait(30)
        return at

    def restart_cache(self, timeout_s: float = 120.0) -> None:
        """A fresh cache service on the same address (after `kill(stack.cache)`)."""
        if self.cache.proc.poll() is None:
            self.cache.stop()
        self.cache = start_service("cache", self.cache_args, timeout_s=timeout_s)

    def restart_redis(self) -> None:
        """Kills redis-server and starts an empty one on the same port (no persistence)."""
        assert self.redis is not None, "the stack runs the shm backend"
        port = self.redis.port
        self.redis.proc.kill()
        self.redis.proc.wait(10)
        self.redis = RedisServer.start(port=port)

    # -- probes ----------------------------------------------------------------------------------------
    def compute_stub(self, svc: ServiceProcess) -> compute_pb2_grpc.ComputeStub:
        ch = self._channels.get(svc.address)
        if ch is None:
            ch = self._channels[svc.address] = grpc.insecure_channel(svc.address)
        return compute_pb2_grpc.ComputeStub(ch)

    def compute_stats(self, svc: ServiceProcess) -> compute_pb2.GetStatsResponse:
        return self.compute_stub(svc).GetStats(compute_pb2.GetStatsRequest(), timeout=30)

    def num_running(self) -> int:
        """Sequences running or waiting on the live replicas."""
        return sum(s.num_running + s.num_waiting for s in (self.compute_stats(c) for c in self.computes
                                                             if c.proc.poll() is None))

    def compute_metric(self, svc: ServiceProcess, name: str) -> float:
        """One unlabelled figure of a compute replica's Prometheus endpoint (NaN when it is not there)."""
        url = f"http://127.0.0.1:{self.metrics_ports[svc.name]}/metrics"
        text = urllib.request.urlopen(url, timeout=30).read().decode()
        m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
        return float(m.group(1)) if m else float("nan")

    def churn(self) -> dict[str, float]:
        """Preemptions and adapter evictions so far, summed over the live replicas."""
        live = [c for c in self.computes if c.proc.poll() is None]
        return {key: sum(self.compute_metric(c, f"loraplex_{name}") for c in live)
                for key, name in (("preemptions", "compute_preemptions"), ("adapter_evictions", "adapter_evictions"))}

    def rss(self) -> dict[str, int]:
        """Resident memory of each live service process, in bytes."""
        return {svc.name: rss_bytes(svc.proc.pid) for svc in (self.gateway, *self.computes, self.cache)
                if svc.proc.poll() is None}

    def leaks(self) -> dict[str, int]:
        """Everything that must be zero when no request runs (live services only)."""
        out: dict[str, int] = {}
        for svc in self.computes:
            if svc.proc.poll() is not None:
                continue
            s = self.compute_stats(svc)
            for key, value in (("running", s.num_running), ("waiting", s.num_waiting),
                               ("kv_blocks_used", s.kv_blocks_used), ("adapter_pins", s.adapter_pins),
                               ("adapter_requests", sum(a.num_running + a.num_waiting for a in s.adapter_requests)),
                               ("stale_shm_maps", len(stale_shm_maps(svc.proc.pid)))):
                out[f"{svc.name}.{key}"] = value
        if self.cache.proc.poll() is None and "shm" in self.cache_args:
            sealed, blank = shm_segments(self.cache.proc.pid)
            out["cache.shm_segments_beyond_adapters"] = max(0, len(sealed) - self.cached_adapters())
            out["cache.blank_shm_segments_beyond_spares"] = max(0, len(blank) - MAX_SPARES)
        return out

    def wait_no_leaks(self, timeout_s: float = 10.0) -> dict[str, int]:
        """Polls `leaks()` until every figure is zero or `timeout_s` passes; returns the last reading."""
        deadline = time.monotonic() + timeout_s
        while True:
            found = self.leaks()
            if not any(found.values()) or time.monotonic() > deadline:
                return found
            time.sleep(0.1)

    def cached_adapters(self) -> int:
        from loraplex.v1 import cache_pb2, cache_pb2_grpc

        with grpc.insecure_channel(self.cache.address) as ch:
            return len([a for a in cache_pb2_grpc.AdapterCacheStub(ch).ListAdapters(
                cache_pb2.ListAdaptersRequest(), timeout=30).adapters if a.in_host_cache])


def shm_segments(pid: int, shm_dir: str = "/dev/shm") -> tuple[list[str], list[str]]:
    """The host cache's segments of process `pid` present in /dev/shm: (sealed ones, holding an adapter;
    blank ones: spares made ahead of time, or a put still being written)."""
    root = Path(shm_dir)
    sealed, blank = [], []
    for p in (root.iterdir() if root.is_dir() else ()):
        if p.name.startswith(f"loraplex-{pid}-"):
            try:
                with p.open("rb") as f:
                    head = f.read(len(MAGIC))
            except OSError:     # retired meanwhile
                continue
            (sealed if head == MAGIC else blank).append(p.name)
    return sealed, blank


_DELETED_SEGMENT = re.compile(r"/dev/shm/loraplex-\S+ \(deleted\)$")


def stale_shm_maps(pid: int) -> list[str]:
    """Host-cache segments process `pid` still maps although the cache dropped them (unlinked)."""
    try:
        lines = Path(f"/proc/{pid}/maps").read_text().splitlines()
    except OSError:
        return []
    return sorted({ln.split()[-2] for ln in lines if _DELETED_SEGMENT.search(ln)})


def redis_available() -> bool:
    return shutil.which("redis-server") is not None


def rss_bytes(pid: int) -> int:
    """Resident memory of `pid` (0 when it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def env_int(name: str, default: int) -> int:
    """An integer from the environment (how CI and a GPU run pick their scale)."""
    raw = os.environ.get(name, "")
    return int(raw) if raw.strip() else default


def kill_quietly(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait(10)
