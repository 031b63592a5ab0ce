"""API keys reload without a restart: `kill -HUP` on a real gateway process reads its key file again;
a bad or emptied file leaves the keys in force; a key that stays keeps its rate bucket."""
from __future__ import annotations

import asyncio
import os
import signal
import time

import grpc
import pytest

from gateway.api_keys import KeyEntry, format_entry, hash_key
from gateway.auth import AccessControl, Limits, reload_keys
from gateway.config import GatewayConfig
from loraplex.procs import start_service
from loraplex.v1 import gateway_pb2, gateway_pb2_grpc

pytestmark = pytest.mark.timeout(120)

OLD, NEW = "lpx-old-" + "a" * 30, "lpx-new-" + "b" * 30


def _write(path, *entries: KeyEntry) -> None:
    path.write_text("\n".join(format_entry(e, "toml") for e in entries))


def test_reload_swaps_keys_keeps_buckets_and_refuses_bad_or_empty_files(tmp_path, caplog):
    path = tmp_path / "keys.toml"
    _write(path, KeyEntry("old", hash_key(OLD), rate=1.0, burst=1))
    config = GatewayConfig(api_keys_file=str(path))
    now = [0.0]
    access = AccessControl([KeyEntry("old", hash_key(OLD), rate=1.0, burst=1)], Limits(), clock=lambda: now[0])
    access.authorize(OLD, "generate")                                  # its one token spent
    _write(path, KeyEntry("old", hash_key(OLD), rate=1.0, burst=1), KeyEntry("new", hash_key(NEW)))
    assert reload_keys(access, config)
    assert access.authorize(NEW, "generate").name == "new"
    with pytest.raises(Exception, match="over its rate"):              # the kept key's bucket is still empty
        access.authorize(OLD, "generate")
    path.write_text("this is not a key line\n")
    assert not reload_keys(access, config)                              # refused: the two keys stay
    assert sorted(access.key_names()) == ["new", "old"]
    path.write_text("# every key revoked\n")
    assert not reload_keys(access, config)                              # refused: would open the gateway
    assert sorted(access.key_names()) == ["new", "old"]
    assert "refusing to open the gateway" in caplog.text


def _code(address: str, key: str) -> grpc.StatusCode:
    async def call() -> grpc.StatusCode:
        async with grpc.aio.insecure_channel(address) as ch:
            try:
                await gateway_pb2_grpc.GatewayStub(ch).ListLoras(
                    gateway_pb2.ListLorasRequest(), metadata=(("authorization", f"Bearer {key}"),), timeout=5)
            except grpc.aio.AioRpcError as e:
                return e.code()
            return grpc.StatusCode.OK
    return asyncio.run(call())


def test_sighup_reloads_a_running_gateways_key_file(tmp_path):
    path = tmp_path / "keys.toml"
    _write(path, KeyEntry("old", hash_key(OLD)))
    cache = start_service("cache", ["cache", "--listen", "127.0.0.1:0"])
    gateway = None
    try:
        gateway = start_service("gateway", ["gateway", "--listen", "127.0.0.1:0", "--cache-address", cache.address,
                                            "--compute-addresses", "127.0.0.1:9", "--api-keys-file", str(path)])
        unauth = grpc.StatusCode.UNAUTHENTICATED
        assert _code(gateway.address, OLD) != unauth and _code(gateway.address, NEW) == unauth
        _write(path, KeyEntry("new", hash_key(NEW)))                    # "old" revoked, "new" added
        os.kill(gateway.proc.pid, signal.SIGHUP)
        deadline = time.monotonic() + 20
        while _code(gateway.address, OLD) != unauth and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _code(gateway.address, OLD) == unauth and _code(gateway.address, NEW) != unauth
        assert gateway.proc.poll() is None                              # still serving: no restart
        assert "API keys reloaded" in gateway.output() and NEW not in gateway.output()
    finally:
        for svc in (gateway, cache):
            if svc is not None:
                svc.stop()
