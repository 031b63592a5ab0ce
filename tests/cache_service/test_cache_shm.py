"""Shared-memory segments: unlinked on eviction and shutdown, untouched by crashing clients."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from cache_helpers import run, start_cache, valid_adapter
from loraplex.cache_client import CacheClient
from cache_service.shm_backend import ShmBackend
from cache_service.shm_segments import OwnedSegment, sweep_dead_owners

SHM = Path("/dev/shm")
pytestmark = pytest.mark.skipif(not SHM.is_dir(), reason="needs /dev/shm (Linux)")


def _segments(pid: int) -> list[str]:
    return sorted(p.name for p in SHM.glob(f"loraplex-{pid}-*"))


def test_backend_unlinks_on_evict_replace_and_close():
    backend = ShmBackend(1 << 20)
    from test_cache_backends import _put

    _put(backend, 1, 1000)
    _put(backend, 2, 1000)
    names = backend.segment_names()
    assert all((SHM / n).exists() for n in names)
    backend.evict(1)
    assert not (SHM / names[0]).exists() and (SHM / names[1]).exists()
    _put(backend, 2, 500, replace=True)
    assert not (SHM / names[1]).exists()
    live = backend.segment_names()
    backend.close()
    assert not any((SHM / n).exists() for n in live)


def test_sweep_removes_segments_of_dead_owners():
    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(child.stdout)
    seg = OwnedSegment(f"{dead_pid}-deadbeef", 100)
    mine = OwnedSegment(f"{os.getpid()}-cafe0000", 100)
    try:
        removed = sweep_dead_owners()
        assert seg.name in removed and mine.name not in removed
        assert not (SHM / seg.name).exists() and (SHM / mine.name).exists()
    finally:
        seg.retire()
        mine.retire()


def test_segments_gone_after_shutdown_and_mapped_copy_survives(tmp_path, tiny_model):
    svc = start_cache(tmp_path, tiny_model, "shm", extra=("--shm-spare-bytes", "0"))   # count adapters only
    pid = svc.proc.proc.pid
    adapter = valid_adapter(svc.spec, rank=3)

    async def body():
        async with CacheClient(svc.address) as c:
            await c.put_adapter(adapter, 11)
            return await c.get_adapter(11)

    try:
        mapped = run(body())
        assert len(_segments(pid)) == 2  # the prefetched adapter and this one
    finally:
        assert svc.proc.stop() == 0
    assert _segments(pid) == []
    # A holder that mapped the adapter keeps valid weights after the segment is unlinked.
    assert torch.equal(mapped.weights, adapter.weights)


def test_crashing_client_does_not_destroy_segments(tmp_path, tiny_model):
    svc = start_cache(tmp_path, tiny_model, "shm", extra=("--shm-spare-bytes", "0"))   # count adapters only
    pid = svc.proc.proc.pid
    adapter = valid_adapter(svc.spec, rank=2)
    script = textwrap.dedent(f"""
        import asyncio, os, signal
        from loraplex.cache_client import CacheClient
        async def main():
            async with CacheClient({svc.address!r}) as c:
                a = await c.get_adapter(12)
                assert float(a.weights.float().abs().sum()) > 0
                print("mapped", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
        asyncio.run(main())
    """)
    try:
        run(_put(svc, adapter, 12))
        before = _segments(pid)
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
        assert out.returncode == -signal.SIGKILL and "mapped" in out.stdout, out.stderr
        time.sleep(0.5)
        assert _segments(pid) == before
        got = run(_get(svc, 12))
        assert torch.equal(got.weights, adapter.weights)
    finally:
        svc.proc.stop()


async def _put(svc, adapter, task_id):
    async with CacheClient(svc.address) as c:
        await c.put_adapter(adapter, task_id)


async def _get(svc, task_id):
    async with CacheClient(svc.address) as c:
        return await c.get_adapter(task_id)


def test_killed_service_segments_are_cleaned(tmp_path, tiny_model):
    svc = start_cache(tmp_path, tiny_model, "shm")
    pid = svc.proc.proc.pid
    assert _segments(pid)
    svc.proc.proc.send_signal(signal.SIGKILL)
    svc.proc.proc.wait(10)
    deadline = time.monotonic() + 10
    while _segments(pid) and time.monotonic() < deadline:
        time.sleep(0.1)  # multiprocessing's resource tracker outlives its parent and unlinks them
    if _segments(pid):
        sweep_dead_owners()  # what the next service start does
    assert _segments(pid) == []
