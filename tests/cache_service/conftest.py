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
