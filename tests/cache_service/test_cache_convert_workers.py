"""`loraplex cache --convert-processes N`: never-seen PEFT adapters are converted by worker processes, with
the same bytes and version as the service's own conversion (off by default until measured on a GPU host)."""
from __future__ import annotations

import asyncio
import urllib.request

import pytest
from test_cache_disk_loads import write_adapter

from loraplex.cache_client import CacheClient
from loraplex.cli.serve_procs import free_port
from loraplex.formats import read_peft, validate
from loraplex.procs import start_service


def test_workers_default_to_auto_and_counts_are_checked():
    from cache_service.config import CacheConfig, auto_convert_processes

    assert CacheConfig().convert_processes == -1
    assert [auto_convert_processes(n) for n in (1, 2, 4, 7, 8, 12, 16, 64)] == [0, 0, 0, 0, 2, 3, 4, 4]
    CacheConfig(convert_processes=0)
    with pytest.raises(Exception, match="convert_processes"):
        CacheConfig(convert_processes=-2)


def test_auto_follows_the_cores_the_service_may_use(tiny_model, tmp_path, monkeypatch):
    from cache_service.config import CacheConfig
    from cache_service import server

    for cpus, expected in ((2, None), (16, 4)):
        monkeypatch.setattr(server, "usable_cpus", lambda n=cpus: n)
        cache = server.build_cache(CacheConfig(model=str(tiny_model[0]), lora_root=str(tmp_path)))
        try:
            assert (cache.convert.processes if cache.convert is not None else None) == expected
        finally:
            cache.close()


def test_build_cache_gives_shm_its_workers(tiny_model, tmp_path):
    from cache_service.config import CacheConfig
    from cache_service.server import build_cache

    cache = build_cache(CacheConfig(model=str(tiny_model[0]), convert_processes=2, lora_root=str(tmp_path)))
    try:
        assert cache.convert is not None and cache.convert.processes == 2 and cache.convert.local_first
    finally:
        cache.close()
    cache = build_cache(CacheConfig(model=str(tiny_model[0]), convert_processes=0))
    try:
        assert cache.convert is None
    finally:
        cache.close()


@pytest.mark.slow
def test_service_converts_named_adapters_in_its_workers(tiny_model, tmp_path):
    root = tmp_path / "root"
    for i in range(4):
        write_adapter(root / f"n{i}", seed=10 + i)
    port = free_port()
    cache = start_service("cache", ["cache", "--listen", "127.0.0.1:0", "--model", str(tiny_model[0]),
                                    "--lora-root", str(root), "--convert-processes", "2",
                                    "--no-convert-local-first",
                                    "--metrics-port", str(port)], timeout_s=120)
    try:
        async def resolve_all():
            async with CacheClient(cache.address) as client:
                return await asyncio.gather(*[client.resolve_name(f"n{i}") for i in range(4)])

        got = asyncio.run(resolve_all())
        want = [validate(read_peft(root / f"n{i}"), tiny_model[1], 256).content_hash for i in range(4)]
        assert [version for _, version in got] == want
        assert "conversion workers: 2 processes ready" in cache.output()
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        assert 'loraplex_host_cache_conversions_total{where="worker"} 4.0' in metrics
    finally:
        cache.stop()
