"""Fixtures for the host cache tests: a real redis-server, random adapters, both backends."""
from __future__ import annotations

import shutil
import socket
import subprocess
import time
import uuid

import numpy as np
import pytest
import redis
import torch

from loraplex.formats.adapter import Adapter, AdapterMetadata


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """A foreground redis-server on a free port that tests can kill and restart."""

    def __init__(self) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            pytest.skip("redis-server is not installed (apt-get install -y redis-server)")
        self.exe = exe
        self.port = _free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [self.exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=self.port, socket_connect_timeout=0.5)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.exceptions.ConnectionError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError("redis-server did not start")
                time.sleep(0.05)
        client.close()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture(scope="session")
def redis_server():
    server = RedisServer()
    server.start()
    yield server
    server.kill()


@pytest.fixture
def redis_restartable():
    """A private redis-server a test may kill and restart (same port)."""
    server = RedisServer()
    server.start()
    yield server
    server.kill()


def random_adapter(num_rows: int = 3, width: int = 40, *, dtype: torch.dtype = torch.float16,
                   seed: int | None = None, rank: int = 2) -> Adapter:
    """A converted adapter with fresh random (never zero) weights; not model-validated."""
    gen = torch.Generator().manual_seed(seed if seed is not None else int(np.random.randint(1 << 30)))
    weights = (torch.rand(num_rows, width, generator=gen) + 0.5).to(dtype)
    config = np.array([[1 + i % 7, i, rank] for i in range(num_rows)], dtype=np.int32)
    return Adapter(config=config, weights=weights, metadata=AdapterMetadata(source="inline"))


@pytest.fixture(params=["shm", "redis"])
def backend(request):
    """Each backend with a 4 KiB budget, fresh per test."""
    from cache_service.redis_backend import RedisBackend
    from cache_service.shm_backend import ShmBackend

    if request.param == "shm":
        b = ShmBackend(4096)
    else:
        server = request.getfixturevalue("redis_server")
        b = RedisBackend(server.url, 4096, fingerprint=uuid.uuid4().hex[:8])
    yield b
    b.close()


TINY_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
               "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
               "head_dim": 16, "intermediate_size": 96, "vocab_size": 128}


def valid_adapter(spec, *, rank: int = 4, module_ids=(1, 2, 3, 4, 5, 6, 7), layers=None,
                  dtype: torch.dtype = torch.float16, seed: int | None = None) -> Adapter:
    """A converted adapter that fits `spec`: random A/B (never zero), zero padding."""
    gen = torch.Generator().manual_seed(seed if seed is not None else int(np.random.randint(1 << 30)))
    layers = range(spec.num_layers) if layers is None else layers
    rows = [(m, layer) for layer in layers for m in module_ids]
    shapes = [spec.module_shape(m) for m, _ in rows]
    width = max(rank * (s.in_features + s.out_features) for s in shapes)
    weights = torch.empty(len(rows), width, dtype=dtype).uniform_(0.01, 0.21, generator=gen)
    for i, s in enumerate(shapes):
        weights[i, rank * (s.in_features + s.out_features):] = 0  # padding must be zero
    config = np.array([[m, layer, rank] for m, layer in rows], dtype=np.int32)
    return Adapter(config=config, weights=weights, metadata=AdapterMetadata(source="inline"))


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """(path of a tiny Llama config.json, its ModelSpec)."""
    import json

    from loraplex.formats import ModelSpec

    path = tmp_path_factory.mktemp("tiny_model") / "config.json"
    path.write_text(json.dumps(TINY_CONFIG))
    return path, ModelSpec.from_hf_config(TINY_CONFIG)


class CacheService:
    """A real cache service process plus what the tests need to know about it."""

    def __init__(self, proc, backend: str, root, prefetch, spec, budget: int) -> None:
        self.proc = proc
        self.backend = backend
        self.address = proc.address
        self.root = root
        self.prefetch = prefetch
        self.spec = spec
        self.budget = budget


def start_cache(tmp_path, tiny_model, backend: str, *, budget: int = 100_000, redis_url: str = "",
                extra: tuple[str, ...] = ()):
    from loraplex.formats import save_adapter
    from loraplex.procs import start_service

    model_path, spec = tiny_model
    root = tmp_path / "root"
    prefetch = tmp_path / "prefetch"
    root.mkdir(exist_ok=True)
    prefetch.mkdir(exist_ok=True)
    save_adapter(valid_adapter(spec, rank=2, seed=11), prefetch / "42", "npy")
    args = ["cache", "--listen", "127.0.0.1:0", "--backend", backend, "--model", str(model_path),
            "--host-cache-bytes", str(budget), "--lora-root", str(root), "--lora-prefetch-dir", str(prefetch),
            "--max-lora-rank", "16", "--chunk-bytes", "8192", *extra]
    if backend == "redis":
        args += ["--redis-url", redis_url, "--redis-prefix", f"t{uuid.uuid4().hex[:8]}"]
    proc = start_service(f"cache-{backend}", args)
    return CacheService(proc, backend, root, prefetch, spec, budget)


@pytest.fixture(scope="module", params=["shm", "redis"])
def service(request, tmp_path_factory, tiny_model):
    """A cache service per backend, shared by a test module (tests clear what they rely on)."""
    url = request.getfixturevalue("redis_server").url if request.param == "redis" else ""
    svc = start_cache(tmp_path_factory.mktemp(f"svc_{request.param}"), tiny_model, request.param, redis_url=url)
    yield svc
    assert svc.proc.stop() == 0, svc.proc.output()


def run(coro):
    """Runs one coroutine on a fresh event loop (tests are synchronous)."""
    import asyncio

    return asyncio.run(coro)
