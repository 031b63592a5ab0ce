"""The cache service shortens Python's thread switch interval (as the gateway and compute do): several
conversions, the spare maker and the event loop share the GIL, and with Python's 5 ms each hand-off of
it could wait that long (16 cold adapters at once: 1.39-1.71 s at 5 ms, 1.19-1.23 s at 0.5 ms, 2 cores)."""
from __future__ import annotations

import pytest


def test_cache_switch_interval_setting():
    from cache_service.config import CacheConfig
    from loraplex.settings import SettingsError

    assert CacheConfig().gil_switch_interval_us == 500
    with pytest.raises(SettingsError, match="gil_switch_interval_us"):
        CacheConfig(gil_switch_interval_us=-1)


def test_cache_service_applies_its_switch_interval_first(monkeypatch, tmp_path):
    import asyncio
    import sys

    from cache_service import server
    from cache_service.config import CacheConfig

    seen: list[float] = []
    monkeypatch.setattr(sys, "setswitchinterval", seen.append)
    with pytest.raises(BaseException):      # no model there: the service stops before it listens
        asyncio.run(server.serve(CacheConfig(model=str(tmp_path / "missing.gguf"), gil_switch_interval_us=300)))
    assert seen == [300e-6]
