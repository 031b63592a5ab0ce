"""PEFT folders from the adapter root are converted straight into their shared-memory segment."""
from __future__ import annotations

import json
import threading
import time
import types

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from loraplex import errors
from loraplex.formats import read_peft, validate
from cache_service import single_flight
from cache_service.convert_procs import ConvertProcesses
from cache_service.host_cache import HostCache
from cache_service.shm_backend import ShmBackend

PROJ = {"q_proj": ("self_attn", 64, 64), "v_proj": ("self_attn", 64, 32), "up_proj": ("mlp", 64, 96),
        "down_proj": ("mlp", 96, 64)}


def write_adapter(folder, seed, dtype=torch.bfloat16, rank=8):
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(2):
        for proj, (block, fin, fout) in PROJ.items():
            key = f"base_model.model.model.layers.{layer}.{block}.{proj}"
            tensors[f"{key}.lora_A.weight"] = (torch.randn(rank, fin, generator=gen) * 0.1).to(dtype)
            tensors[f"{key}.lora_B.weight"] = (torch.randn(fout, rank, generator=gen) * 0.1).to(dtype)
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 16, "target_modules": list(PROJ)}))
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    return tensors


@pytest.fixture(scope="module")
def workers():
    convert = ConvertProcesses(1, local_first=False)
    convert.start()
    yield convert
    convert.close()


@pytest.fixture(params=["in-process", "workers"])
def cache(request, tmp_path, tiny_model):
    """Each test runs with the rows converted in this process and by a conversion worker process."""
    convert = request.getfixturevalue("workers") if request.param == "workers" else None
    backend = ShmBackend(64 << 20)
    yield HostCache(backend, tiny_model[1], max_lora_rank=64, lora_root=str(tmp_path), convert=convert)
    backend.close()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_named_peft_lands_as_read_peft_would_convert_it(cache, tmp_path, tiny_model, dtype):
    write_adapter(tmp_path / "good", seed=1, dtype=dtype)
    task_id, version = cache.resolve_name("good")
    ref = validate(read_peft(tmp_path / "good"), tiny_model[1], 64)
    assert version == ref.content_hash
    assert conversions(cache, "worker" if cache.convert else "service") == 1     # where the rows were written
    with cache.get(task_id) as reader:
        got = torch.frombuffer(bytearray(b"".join(bytes(c) for c in reader.chunks(1 << 20))), dtype=dtype)
        assert torch.equal(got.view(ref.weights.shape), ref.weights)
        assert reader.record.in_out == ref.in_out and reader.record.original_format == "peft"


def test_non_finite_factor_is_refused_naming_its_row_and_leaves_no_segment(cache, tmp_path):
    tensors = write_adapter(tmp_path / "bad", seed=2)
    key = "base_model.model.model.layers.1.mlp.up_proj.lora_B.weight"
    tensors[key][3, 1] = float("nan")
    save_file(tensors, str(tmp_path / "bad" / "adapter_model.safetensors"))
    with pytest.raises(errors.InvalidArgumentError, match="row 5: nan at column 537"):
        cache.resolve_name("bad")
    assert cache.backend.segment_names() == [] and cache.backend.stats().num_adapters == 0


def conversions(cache, where: str) -> float:
    """PEFT adapters the cache converted with their rows written by `where` ("worker" or "service")."""
    return cache.metrics.registry.get_sample_value("loraplex_host_cache_conversions_total", {"where": where}) or 0


def run_together(n, fn):
    """`fn()` from n threads released at once; each result or exception."""
    barrier, out = threading.Barrier(n), [None] * n

    def one(i):
        barrier.wait()
        try:
            out[i] = fn()
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            out[i] = exc
    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def test_concurrent_requests_for_a_new_name_share_one_conversion(cache, tmp_path):
    write_adapter(tmp_path / "burst", seed=3, rank=32)
    results = run_together(8, lambda: cache.resolve_name("burst"))
    assert len(set(results)) == 1 and not isinstance(results[0], Exception)
    assert cache.metrics.registry.get_sample_value("loraplex_adapter_load_seconds_count", {"tier": "host"}) == 1
    assert len(cache.backend.segment_names()) == 1


def hold_load_until_the_others_wait(cache, monkeypatch, n):
    """The load runs only once the other n - 1 callers are inside the single flight waiting for its outcome (or
    after 10 s): a LoadPath is an explicit load, so a caller the scheduler started after the first load had
    finished would rightly load again; held, the test checks the sharing, not the thread timing."""
    waiting = threading.Semaphore(0)

    class Shared(single_flight.Future):
        def result(self, timeout=None):
            waiting.release()           # this caller found the load in flight and shares its outcome
            return super().result(timeout)

    real_store = cache._store_from_disk

    def store(*args, **kwargs):
        deadline = time.monotonic() + 10
        for _ in range(n - 1):
            waiting.acquire(timeout=max(0.0, deadline - time.monotonic()))
        return real_store(*args, **kwargs)
    monkeypatch.setattr(single_flight, "Future", Shared)
    monkeypatch.setattr(cache, "_store_from_disk", store)


def test_concurrent_load_path_calls_for_one_folder_share_one_conversion(cache, tmp_path, monkeypatch):
    write_adapter(tmp_path / "team" / "v2", seed=6, rank=32)
    hold_load_until_the_others_wait(cache, monkeypatch, 6)
    results = run_together(6, lambda: cache.load_path("team/v2", None, "team_v2", True))
    assert not any(isinstance(r, Exception) for r in results), results
    assert len({r.record.version for r in results}) == 1
    assert cache.metrics.registry.get_sample_value("loraplex_adapter_load_seconds_count", {"tier": "host"}) == 1
    assert len(cache.backend.segment_names()) == 1


def stale_first_look(cache, monkeypatch):
    """The backend's next `get` and `has` each answer a miss once: a caller that looked just before another
    caller's load of the same adapter stored it, and reaches the load just after that load finished."""
    for method in ("get", "has"):
        real, looks = getattr(cache.backend, method), []

        def stale(task_id, *args, real=real, looks=looks):
            looks.append(task_id)
            return None if len(looks) == 1 else real(task_id, *args)
        monkeypatch.setattr(cache.backend, method, stale)


@pytest.mark.parametrize("how", ["name", "task id"])
def test_a_caller_that_saw_the_miss_late_keeps_the_load_that_just_finished(cache, tmp_path, monkeypatch, how):
    write_adapter(tmp_path / "late", seed=5)
    task_id, version = cache.resolve_name("late")
    stale_first_look(cache, monkeypatch)
    if how == "name":
        assert cache.resolve_name("late") == (task_id, version)
    else:
        with cache.get(task_id) as reader:
            assert reader.record.version == version
    assert cache.metrics.registry.get_sample_value("loraplex_adapter_load_seconds_count", {"tier": "host"}) == 1


def test_concurrent_requests_for_a_bad_adapter_all_get_the_refusal(cache, tmp_path):
    tensors = write_adapter(tmp_path / "badburst", seed=4)
    tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"][0, 0] = float("inf")
    save_file(tensors, str(tmp_path / "badburst" / "adapter_model.safetensors"))
    results = run_together(6, lambda: cache.resolve_name("badburst"))
    assert all(isinstance(r, errors.InvalidArgumentError) and "row" in str(r) for r in results)
    assert cache.backend.segment_names() == []


def test_row_fills_of_different_adapters_run_one_at_a_time():
    """Concurrent conversions (a burst of new names) fill their rows one after another: the fill is
    GIL-bound, and side by side the fills spent more on handing the GIL around than on the work."""
    import time as _time

    from cache_service import disk_loads

    spans: list[tuple[float, float]] = []

    class Rows:
        config = np.asarray([[1, 0, 1]], dtype=np.int32)     # one row of rank 1, 1 x 1: 4 bytes of fp16
        in_out = ((1, 1),)
        dtype = torch.float16
        shape = (1, 2)

        def fill(self, out, *, check_finite, on_row):
            start = _time.perf_counter()
            _time.sleep(0.03)
            on_row(0)
            spans.append((start, _time.perf_counter()))

    class Upload:
        writer = types.SimpleNamespace(buffer=bytearray(4))
        versions: list[str] = []

        def weights_view(self):
            return None

        def mark_filled(self, values_checked, version):
            self.versions.append(version)

    threads = [threading.Thread(target=disk_loads._fill, args=(Rows(), Upload())) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    spans.sort()
    assert len(spans) == 3
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), spans
    assert len(Upload.versions) == 3 and len(set(Upload.versions)) == 1      # hashed as the rows were written


def _cache_with_a_worker(tmp_path, tiny_model, local_first: bool):
    """(its one conversion worker, started; the shm backend; the cache over both)."""
    convert = ConvertProcesses(1, local_first=local_first)
    convert.start()
    backend = ShmBackend(64 << 20)
    return convert, backend, HostCache(backend, tiny_model[1], max_lora_rank=64, lora_root=str(tmp_path),
                                       convert=convert)


def test_conversion_workers_convert_and_a_dead_worker_fails_no_load(tmp_path, tiny_model):
    """The rows are written by the worker process; after the workers are killed, the next load is
    converted in the service's process (same bytes, same version) and the pool is made again."""
    import os
    import signal

    convert, backend, cache = _cache_with_a_worker(tmp_path, tiny_model, local_first=False)
    try:
        write_adapter(tmp_path / "first", seed=5)
        write_adapter(tmp_path / "second", seed=6)
        assert cache.resolve_name("first")[1] == validate(read_peft(tmp_path / "first"), tiny_model[1], 64).content_hash
        assert conversions(cache, "worker") == 1
        for pid in list(convert._pool._processes):      # noqa: SLF001 - the test kills the workers
            os.kill(pid, signal.SIGKILL)
        task_id, version = cache.resolve_name("second")
        assert version == validate(read_peft(tmp_path / "second"), tiny_model[1], 64).content_hash
        assert conversions(cache, "worker") == conversions(cache, "service") == 1
        assert len(backend.segment_names()) == 2
        write_adapter(tmp_path / "third", seed=7)
        cache.resolve_name("third")                      # a new pool of workers
        assert conversions(cache, "worker") == 2
    finally:
        convert.close()
        backend.close()


def test_a_lone_conversion_runs_in_the_service_and_one_beside_it_in_a_worker(tmp_path, tiny_model):
    """With workers and `local_first` (the default), a conversion that finds none running in the service's
    process converts there; one that arrives while another holds the fill goes to a worker. Same versions
    either way."""
    from cache_service import disk_loads

    convert, backend, cache = _cache_with_a_worker(tmp_path, tiny_model, local_first=True)
    try:
        write_adapter(tmp_path / "alone", seed=8)
        write_adapter(tmp_path / "beside", seed=9)
        assert cache.resolve_name("alone")[1] == validate(read_peft(tmp_path / "alone"), tiny_model[1], 64).content_hash
        assert conversions(cache, "service") == 1 and conversions(cache, "worker") == 0
        with disk_loads._FILL_ONE_AT_A_TIME:          # another conversion is filling in the service
            version = cache.resolve_name("beside")[1]
        assert version == validate(read_peft(tmp_path / "beside"), tiny_model[1], 64).content_hash
        assert conversions(cache, "service") == 1 and conversions(cache, "worker") == 1
    finally:
        convert.close()
        backend.close()
