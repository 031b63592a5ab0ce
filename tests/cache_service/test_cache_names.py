"""Named adapters from the adapter root: stable ids, reload after eviction, new versions, traversal refused."""
from __future__ import annotations

import os
import shutil
import time

import pytest

from cache_helpers import run, valid_adapter
from loraplex import errors
from loraplex.cache_client import CacheClient
from loraplex.formats import save_adapter, validate
from cache_service import sources
from cache_service.sources import task_id_for_name


def test_task_ids_are_stable_63_bit_and_distinct():
    ids = {task_id_for_name(f"adapter-{i}") for i in range(1000)}
    assert len(ids) == 1000 and all(0 <= t < 2**63 for t in ids)
    assert task_id_for_name("my_finetuning") == task_id_for_name("my_finetuning")


@pytest.mark.parametrize("name", ["../etc", "..", "a/b", "a\\b", ".hidden", "", "x" * 300, "a\0b", "/abs"])
def test_bad_names_refused(name):
    with pytest.raises(errors.InvalidArgumentError):
        sources.check_name(name)


def test_symlink_escaping_root_refused(tmp_path):
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (outside / "evil.safetensors").write_bytes(b"x")
    os.symlink(outside / "evil.safetensors", root / "evil.safetensors")
    os.symlink(outside, root / "evildir")
    (root / "inner").mkdir()
    os.symlink(outside / "evil.safetensors", root / "inner" / "adapter_model.safetensors")
    for name in ("evil", "evildir", "inner"):
        with pytest.raises(errors.InvalidArgumentError, match="outside the adapter root"):
            sources.find_named(root, name)
    with pytest.raises(errors.InvalidArgumentError):
        sources.resolve_load_path(root, "../outside/evil.safetensors")
    with pytest.raises(errors.InvalidArgumentError):
        sources.resolve_load_path(root, str(outside / "evil.safetensors"))


def _write(service, name: str, fmt: str, seed: int):
    adapter = validate(valid_adapter(service.spec, rank=2, seed=seed), service.spec, 16)
    path = service.root / (f"{name}.safetensors" if fmt == "safetensors" else name)
    if path.exists():
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    save_adapter(adapter, path, fmt)
    return adapter


@pytest.mark.parametrize("fmt", ["npy", "safetensors", "peft"])
def test_name_resolves_loads_and_reloads_after_eviction(service, fmt):
    name = f"named_{fmt}"
    adapter = _write(service, name, fmt, seed=5)

    async def body():
        async with CacheClient(service.address) as c:
            with pytest.raises(errors.NotFoundError, match="not cached"):
                await c.resolve_name(name, load_mode="never")
            task_id, version = await c.resolve_name(name)
            assert await c.evict(name=name)
            again = await c.get_adapter(task_id, allow_shm=False)  # reloaded from disk transparently
            listing = await c.list()
            return task_id, version, again, listing

    task_id, version, again, listing = run(body())
    assert task_id == task_id_for_name(name)
    assert again.content_hash == version
    assert again.metadata.source.endswith(name if fmt != "safetensors" else f"{name}.safetensors")
    if fmt != "peft":  # PEFT round-trips through A/B and a scale; npy/safetensors are byte-exact
        assert version == adapter.content_hash
    entry = next(a for a in listing.adapters if a.task_id == task_id)
    assert entry.name == name and entry.in_host_cache


def test_changed_files_give_a_new_version_never_stale(service):
    first = _write(service, "changing", "npy", seed=1)

    async def body():
        async with CacheClient(service.address) as c:
            t1, v1 = await c.resolve_name("changing")
            old = await c.get_adapter(t1, version=v1)
            time.sleep(0.01)
            second = _write(service, "changing", "npy", seed=2)
            t2, v2 = await c.resolve_name("changing")  # auto: sees the files changed
            new = await c.get_adapter(t2)
            return t1, v1, t2, v2, old, new, second

    t1, v1, t2, v2, old, new, second = run(body())
    assert t1 == t2 and v1 == first.content_hash and v2 == second.content_hash != v1
    assert old.content_hash == v1 and new.content_hash == v2  # the old holder still has its weights


def test_unknown_name_and_traversal_over_grpc(service):
    async def body():
        async with CacheClient(service.address) as c:
            with pytest.raises(errors.NotFoundError, match="no adapter named 'nobody'"):
                await c.resolve_name("nobody")
            for bad in ("../x", "a/b", ".."):
                with pytest.raises(errors.InvalidArgumentError, match="path separators"):
                    await c.resolve_name(bad)
            with pytest.raises(errors.InvalidArgumentError):
                await c.load_path("../../etc/passwd")
            with pytest.raises(errors.InvalidArgumentError, match="outside the adapter root"):
                await c.load_path("/etc")
            with pytest.raises(errors.InvalidArgumentError):
                await c.put_adapter(valid_adapter(service.spec, rank=2), 7001, name="../../x")

    run(body())


def test_load_path_registers_a_name(service):
    sub = service.root / "team" / "v1"
    adapter = valid_adapter(service.spec, rank=2, seed=8)
    save_adapter(adapter, sub, "npy")

    async def body():
        async with CacheClient(service.address) as c:
            info = await c.load_path("team/v1", name="team_v1")
            resolved = await c.resolve_name("team_v1", load_mode="never")
            return info, resolved

    info, resolved = run(body())
    assert info.task_id == task_id_for_name("team_v1") == resolved.task_id
    assert info.version == adapter.content_hash == resolved.version and info.name == "team_v1"


def test_inline_named_adapter_not_reloadable(service):
    adapter = valid_adapter(service.spec, rank=2)

    async def body():
        async with CacheClient(service.address) as c:
            await c.put_adapter(adapter, 7002, name="inline_one", replace=True)
            assert (await c.resolve_name("inline_one")).task_id == 7002
            await c.evict(7002)
            with pytest.raises(errors.NotFoundError, match="resend its weights"):
                await c.resolve_name("inline_one")

    run(body())


def test_removed_or_reformatted_adapter(service):
    _write(service, "moving", "npy", seed=21)
    second = _write(service, "moving_tmp", "safetensors", seed=22)

    async def body():
        async with CacheClient(service.address) as c:
            await c.resolve_name("moving")
            shutil.rmtree(service.root / "moving")
            with pytest.raises(errors.NotFoundError, match="no longer"):
                await c.resolve_name("moving")
            (service.root / "moving_tmp.safetensors").rename(service.root / "moving.safetensors")
            return await c.resolve_name("moving")

    resolved = run(body())
    assert resolved.version == second.content_hash


def test_bad_settings_exit_with_a_message(tmp_path):
    from loraplex.procs import start_service

    for args, message in ((["--lora-root", str(tmp_path / "nope")], "--lora-root"),
                          (["--model", str(tmp_path / "missing.gguf")], "does not exist")):
        with pytest.raises(RuntimeError, match=message) as info:
            start_service("cache", ["cache", "--listen", "127.0.0.1:0", *args], timeout_s=60)
        assert "exited with 2" in str(info.value)
