"""A cache service that comes up after its clients, or restarts, is reached within ~2 s of listening.

gRPC's own reconnect backoff grows to 2 minutes: a compute service or gateway whose cache was down for a
while would fail adapter calls (UNAVAILABLE) for up to that long after the cache is back. The client's
channel retries every 0.2-2 s instead (loraplex.channels).
"""
from __future__ import annotations

import asyncio
import socket
import time

import pytest

from cache_helpers import start_cache
from loraplex import errors
from loraplex.cache_client import CacheClient

pytestmark = [pytest.mark.serial, pytest.mark.slow, pytest.mark.timeout(120)]
DOWN_S = 15.0       # gRPC's default backoff would be at an attempt 10 s apart by then


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_cache_that_starts_late_is_reached_within_seconds_of_listening(tmp_path, tiny_model):
    address = f"127.0.0.1:{_free_port()}"

    async def while_down(client: CacheClient) -> None:
        deadline = time.monotonic() + DOWN_S
        while time.monotonic() < deadline:
            with pytest.raises(errors.UnavailableError):
                await client.has(1)
            await asyncio.sleep(0.2)

    async def until_reached(client: CacheClient) -> float:
        up = time.monotonic()
        while time.monotonic() - up < 30:
            try:
                await client.has(1)
                return time.monotonic() - up
            except errors.UnavailableError:
                await asyncio.sleep(0.05)
        return float("inf")

    async def body() -> float:
        client = CacheClient(address)
        try:
            await while_down(client)
            svc = await asyncio.to_thread(start_cache, tmp_path, tiny_model, "shm", extra=("--listen", address))
            try:
                return await until_reached(client)
            finally:
                svc.proc.stop()
        finally:
            await client.close()

    reached_s = asyncio.run(body())
    assert reached_s < 3.5, f"the client reached the cache {reached_s:.1f} s after it listened"


def test_connect_reports_whether_the_cache_answered(tmp_path, tiny_model):
    """`connect` (called by the gateway and compute at start, so the first adapter call does not wait for
    a connection) is True once a cache listens there, False within its timeout when none does."""
    address = f"127.0.0.1:{_free_port()}"

    async def body() -> tuple[bool, float, bool]:
        client = CacheClient(address)
        try:
            t0 = time.monotonic()
            down = await client.connect(0.5)
            waited = time.monotonic() - t0
            svc = await asyncio.to_thread(start_cache, tmp_path, tiny_model, "shm", extra=("--listen", address))
            try:
                up = await client.connect(10.0)
                assert await client.has(1) is None     # and the connection serves calls
            finally:
                svc.proc.stop()
            return down, waited, up
        finally:
            await client.close()

    down, waited, up = asyncio.run(body())
    assert down is False and waited < 2.0
    assert up is True
