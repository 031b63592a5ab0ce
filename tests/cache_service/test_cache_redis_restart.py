"""Redis killed mid-run: UNAVAILABLE while it is down, then the service recovers by itself."""
from __future__ import annotations

import time

import pytest

from cache_helpers import run, start_cache, valid_adapter
from loraplex import errors
from loraplex.cache_client import CacheClient
from loraplex.formats import save_adapter

pytestmark = pytest.mark.serial


def test_redis_killed_and_restarted(tmp_path, tiny_model, redis_restartable):
    svc = start_cache(tmp_path, tiny_model, "redis", redis_url=redis_restartable.url)
    save_adapter(valid_adapter(svc.spec, rank=2, seed=4), svc.root / "survivor", "npy")
    inline = valid_adapter(svc.spec, rank=2)

    async def before():
        async with CacheClient(svc.address) as c:
            await c.put_adapter(inline, 77)
            return await c.resolve_name("survivor")

    async def while_down():
        async with CacheClient(svc.address) as c:
            for call in (lambda: c.get_adapter(77), lambda: c.has(77), lambda: c.put_adapter(inline, 78),
                         c.list, lambda: c.resolve_name("survivor")):
                started = time.monotonic()
                with pytest.raises(errors.UnavailableError, match="redis at redis://127.0.0.1.*unavailable"):
                    await call()
                assert time.monotonic() - started < 15

    async def after():
        async with CacheClient(svc.address) as c:
            with pytest.raises(errors.NotFoundError, match="resend its weights"):
                await c.get_adapter(77)  # inline-only: lost with the restart, as after an eviction
            await c.put_adapter(inline, 77)
            got = await c.get_adapter(77)
            named = await c.resolve_name("survivor")  # named: reloads from disk
            prefetched = await c.get_adapter(42)  # prefetch folder: reloads too
            return got, named, prefetched

    try:
        task_id, version = run(before())
        redis_restartable.kill()
        run(while_down())
        redis_restartable.start()
        got, named, prefetched = run(after())
    finally:
        assert svc.proc.stop() == 0, svc.proc.output()
    assert got.content_hash == inline.content_hash
    assert named == (task_id, version)
    assert prefetched.max_rank == 2
