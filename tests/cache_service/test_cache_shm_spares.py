"""Spare shared-memory segments: made in idle time, taken by puts that fit, never seen by readers as spares."""
from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

from test_cache_backends import _put, _read, _record
from test_cache_disk_loads import write_adapter
from loraplex.cache_client import map_shared_segment
from loraplex.formats import read_peft, validate
from loraplex.v1 import cache_pb2
from cache_service import shm_spares
from cache_service.host_cache import HostCache
from cache_service.shm_backend import ShmBackend
from cache_service.shm_segments import HEADER_BYTES

SHM = Path("/dev/shm")
pytestmark = [pytest.mark.serial, pytest.mark.skipif(not SHM.is_dir(), reason="needs /dev/shm (Linux)")]
N = 1 << 20


@pytest.fixture(autouse=True)
def short_idle(monkeypatch):
    monkeypatch.setattr(shm_spares, "IDLE_S", 0.02)


@pytest.fixture
def backend():
    """A shm backend with room for four 1 MiB spares, expecting 1 MiB puts."""
    b = ShmBackend(64 << 20, spare_bytes=4 * N)
    b.expect_put_bytes(N)
    yield b
    b.close()


def _ready(backend: ShmBackend) -> list[int]:
    assert backend.spares.wait_ready(10)
    return backend.spares.spare_sizes()


def _instance_files(backend: ShmBackend) -> set[str]:
    return {p.name for p in SHM.glob(f"loraplex-{backend.instance}-*")}


def test_spares_are_made_and_a_put_that_fits_takes_one(backend):
    assert _ready(backend) == [N, N]
    spare_names = _instance_files(backend)
    writer = backend.open_writer(N)
    assert writer.segment.name in spare_names          # no fresh segment
    assert not any(writer.buffer)                       # zero-filled, as converters need
    payload = os.urandom(N)
    writer.buffer[:] = payload
    backend.commit(writer, _record(7, N, payload[:8].hex()), False)
    assert _read(backend, 7) == payload
    assert (backend.spares.taken, backend.spares.missed) == (1, 0)
    assert _ready(backend) == [N, N]                     # refilled once idle


def test_a_put_uses_the_first_bytes_of_a_slightly_larger_spare_and_readers_map_exactly_those(backend):
    _ready(backend)
    size = N - N // 16                                  # within 1/8 of the spare
    result, payload = _put(backend, 3, size)
    assert result.stored and backend.spares.taken == 1
    assert _read(backend, 3) == payload
    with backend.get(3) as reader:
        name, offset = reader.shm_location
        loc = cache_pb2.SharedMemoryLocation(segment_name=name, offset=offset, num_bytes=size)
        header = cache_pb2.AdapterHeader(task_id=3, version=payload[:8].hex(), weights_num_bytes=size)
        mm = map_shared_segment(loc, header)             # the compute side's mapping checks pass
        try:
            assert mm[HEADER_BYTES:HEADER_BYTES + size] == payload
        finally:
            mm.close()


def test_puts_that_no_spare_fits_get_fresh_segments(backend):
    _ready(backend)
    _put(backend, 1, N // 2)                           # much smaller: a spare would waste half
    _put(backend, 2, 2 * N)                            # larger than every spare
    assert (backend.spares.taken, backend.spares.missed) == (0, 2)
    # the largest recent put sizes the spares; the smaller ones make room for them (two spares at most)
    assert _ready(backend) == [2 * N, 2 * N]



def test_no_spare_is_made_while_a_put_is_in_flight():
    backend = ShmBackend(64 << 20, spare_bytes=4 * N)
    writer = backend.open_writer(N)                    # in flight: the cache is not idle
    backend.expect_put_bytes(N)
    time.sleep(0.3)
    assert backend.spares.spare_sizes() == []
    writer.abort()
    assert _ready(backend) == [N, N]
    backend.close()


def test_spares_stay_within_the_allowance_and_close_unlinks_them():
    backend = ShmBackend(64 << 20, spare_bytes=N + N // 2)
    backend.expect_put_bytes(N)
    assert _ready(backend) == [N]                           # a second would pass the allowance
    names = _instance_files(backend)
    assert len(names) == 1
    backend.close()
    assert not any((SHM / n).exists() for n in names)

    off = ShmBackend(64 << 20)                              # spare_bytes 0: none, and no thread
    off.expect_put_bytes(N)
    assert off.spares.spare_sizes() == [] and off.spares._thread is None
    off.close()


def test_a_named_adapter_converted_into_a_spare_is_byte_identical(tmp_path, tiny_model):
    write_adapter(tmp_path / "a", seed=3)
    ref = validate(read_peft(tmp_path / "a"), tiny_model[1], 64)
    backend = ShmBackend(64 << 20, spare_bytes=16 * N)
    cache = HostCache(backend, tiny_model[1], max_lora_rank=64, lora_root=str(tmp_path))
    try:
        backend.expect_put_bytes(ref.num_bytes)
        _ready(backend)
        # the converter writes only the factors: the padding is whatever the segment held, so it must be zeros
        task_id, version = cache.resolve_name("a")
        assert backend.spares.taken == 1
        assert version == ref.content_hash
        reader = cache.get(task_id)
        with reader:
            got = b"".join(bytes(c) for c in reader.chunks(1 << 20))
        assert got == ref.weights.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    finally:
        backend.close()


def test_host_cache_start_sizes_the_first_spares_for_an_all_module_rank_64_adapter(tmp_path, tiny_model):
    from cache_service.host_cache import typical_adapter_bytes

    spec = tiny_model[1]
    backend = ShmBackend(64 << 20, spare_bytes=64 << 20)
    cache = HostCache(backend, spec, max_lora_rank=256, lora_root=str(tmp_path))
    try:
        cache.start()
        expected = typical_adapter_bytes(spec, 64)
        widest = max(64 * (s.in_features + s.out_features) for s in map(spec.module_shape, range(1, 8)))
        assert expected == 7 * spec.num_layers * widest * 2
        assert _ready(backend) == [expected, expected]
    finally:
        backend.close()


def test_a_service_stopped_leaves_no_spare_behind(tmp_path, tiny_model):
    from cache_helpers import start_cache

    svc = start_cache(tmp_path, tiny_model, "shm", budget=64 << 20, extra=("--shm-spare-bytes", str(4 * N)))
    pid = svc.proc.proc.pid
    try:
        deadline = time.monotonic() + 30          # the prefetched adapter, then spares made once idle
        while len(list(SHM.glob(f"loraplex-{pid}-*"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(list(SHM.glob(f"loraplex-{pid}-*"))) >= 2
    finally:
        assert svc.proc.stop() == 0
    assert list(SHM.glob(f"loraplex-{pid}-*")) == []


def test_the_spare_allowance_defaults_to_256_mib_and_refuses_negative_values():
    from cache_service.config import CacheConfig
    from loraplex.settings import SettingsError

    assert CacheConfig().shm_spare_bytes == 256 << 20
    assert CacheConfig(shm_spare_bytes=0).shm_spare_bytes == 0
    with pytest.raises(SettingsError):
        CacheConfig(shm_spare_bytes=-1)


def test_puts_larger_than_the_allowance_do_not_stop_spares_for_the_others(backend):
    _ready(backend)
    _put(backend, 1, 8 * N)                             # beyond the 4 MiB allowance: a fresh segment
    assert backend.spares.missed == 1
    assert _ready(backend) == [N, N]                     # spares still sized for the puts that fit
    _put(backend, 2, N)
    assert backend.spares.taken == 1


def test_spares_of_sizes_no_longer_wanted_go_even_when_the_allowance_would_hold_them():
    backend = ShmBackend(64 << 20, spare_bytes=16 * N)
    try:
        backend.expect_put_bytes(N)
        assert _ready(backend) == [N, N]
        _put(backend, 1, 2 * N)                        # puts now come at 2 N
        assert _ready(backend) == [2 * N, 2 * N]        # two spares in all, not four
        assert len(_instance_files(backend)) == 1 + 2
    finally:
        backend.close()


def test_populating_a_segment_leaves_the_gil_to_other_threads():
    """A spare's pages are allocated while puts, hashes and the event loop run: the madvise call must not
    hold the GIL (`mmap.madvise` did, so each chunk froze every other thread of the cache)."""
    import threading

    from cache_service.shm_segments import OwnedSegment, new_instance_tag

    seg = OwnedSegment(new_instance_tag(), 48 << 20)
    ticks: list[float] = []
    calling = threading.Event()
    done = threading.Event()

    def ticker() -> None:
        while not done.is_set():
            if calling.is_set():
                ticks.append(time.perf_counter())
            time.sleep(0.0002)

    th = threading.Thread(target=ticker)
    th.start()
    try:
        calling.set()
        t0 = time.perf_counter()
        try:
            seg.madvise(shm_spares.MADV_POPULATE_WRITE, 0, HEADER_BYTES + seg.num_bytes)   # one call, ~20-50 ms
        except OSError as exc:
            pytest.skip(f"this kernel has no MADV_POPULATE_WRITE ({exc})")
        t1 = time.perf_counter()
    finally:
        done.set()
        th.join()
        seg.retire()
    during = [t for t in ticks if t0 < t < t1]
    assert len(during) >= 5, f"{len(during)} ticks of another thread during a {1e3 * (t1 - t0):.0f} ms madvise"

