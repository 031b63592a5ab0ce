"""The warm-up plan on disk: saved plans load back, any change of what the plan depends on is a miss, a bad
file is recomputed and rewritten, the cache can be turned off, and it never fails a start."""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
from pathlib import Path

import pytest
import torch

from compute_service.warmup_plan import WarmupPlan
from compute_service.warmup_plan_cache import (ENABLE_ENV, PlanCache, PlanKey, cached_plan, plan_cache_applies,
                                               plan_cache_dir, source_digest)

MAX_TOKENS = 300
BUCKETS = [1, 2, 4, 8, 16]


def _key(**changes) -> PlanKey:
    key = PlanKey(sources="ab" * 32, triton_version="3.9.0", torch_version="2.13.0", python_version="3.11.9",
                  device_name="NVIDIA H100 80GB HBM3", num_sms=132, capability=(9, 0), spec="ModelSpec(...)",
                  max_num_batched_tokens=MAX_TOKENS, decode_buckets=tuple(BUCKETS),
                  launched_tokens=tuple(range(1, MAX_TOKENS + 1)), adapters=((0, 8), (1, 64)), dtype="torch.bfloat16",
                  backend="PagedLoraBackend", quantized="6144x4096:4b:g128:d256", pool=(64, 30, 7, 64, 64, 4608),
                  switches="LORAPLEX_PDL=;LORAPLEX_FP16_PAIRS=")
    return dataclasses.replace(key, **changes)


def _changed(value):
    """Another value of the same type: what a new version, device or setting would give."""
    if isinstance(value, str):
        return value + "x"
    if isinstance(value, int):
        return value + 1
    return value[:-1] + (_changed(value[-1]),)


class CountingClassify:
    """A kernel's choices by token count, counting the dry runs asked of it."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, t: int) -> tuple:
        self.calls += 1
        return ("big" if t > 100 else "small", t > 250)


def _lookup(cache: PlanCache | None, classify: CountingClassify):
    return cached_plan(MAX_TOKENS, BUCKETS, lambda t: t, lambda: classify, cache)


def test_a_saved_plan_loads_back_equal_and_no_temporary_file_is_left(tmp_path):
    plan = WarmupPlan([1, 2, 4], [101, 112, 251], [1, 16], 7)
    cache = PlanCache(tmp_path / "plans", _key().digest())
    assert cache.load() is None and cache.save(plan)
    assert cache.load() == plan
    assert [p.name for p in cache.folder.iterdir()] == [f"{cache.key}.json"]
    assert json.loads(cache.path.read_text())["prefill_tokens"] == [101, 112, 251]


@pytest.mark.parametrize("part", [f.name for f in dataclasses.fields(PlanKey)])
def test_any_part_changed_gives_another_key_and_a_miss(tmp_path, part):
    base = _key()
    PlanCache(tmp_path, base.digest()).save(WarmupPlan([1], [101], [1, 16], 3))
    other = _key(**{part: _changed(getattr(base, part))})
    assert other.digest() != base.digest()
    assert PlanCache(tmp_path, other.digest()).load() is None
    assert len(base.digest()) == 64 and base.digest() == _key().digest()      # sha256 hex, stable


def test_the_second_build_reads_the_plan_and_makes_no_dry_run(tmp_path):
    cache = PlanCache(tmp_path, _key().digest())
    first, second = CountingClassify(), CountingClassify()
    computed = _lookup(cache, first)
    cached = _lookup(cache, second)
    assert first.calls >= MAX_TOKENS and second.calls == 0
    assert cached.plan == computed.plan and computed.plan.prefill_tokens == [101, 112, 251, 256]
    assert not computed.from_cache and cached.from_cache and cached.path == computed.path == cache.path
    assert f"saved to {cache.path}" in computed.describe()
    assert cached.describe() == f"plan from cache {cache.path} ({computed.plan.num_classes} launch classes)"


def test_without_a_cache_every_build_makes_the_dry_runs(tmp_path):
    classify = CountingClassify()
    _lookup(None, classify)
    _lookup(None, classify)
    assert classify.calls >= 2 * MAX_TOKENS and not any(tmp_path.iterdir())


@pytest.mark.parametrize("content", [
    "", "{not json", "[]", '{"key": "another"}', "\xff\xfe",
    None,   # a plan saved under another key, copied to this one's name
    '{"key": "K", "decode_buckets": [1], "prefill_tokens": [101], "base_prefill_tokens": [1], "num_classes": "3"}',
    '{"key": "K", "decode_buckets": [true], "prefill_tokens": [], "base_prefill_tokens": [1], "num_classes": 3}',
    '{"key": "K", "decode_buckets": [1], "prefill_tokens": [101], "num_classes": 3}',
])
def test_a_bad_file_is_a_miss_and_is_rewritten(tmp_path, content):
    cache = PlanCache(tmp_path, _key().digest())
    if content is None:
        PlanCache(tmp_path, "other").save(WarmupPlan([1], [101], [1, 16], 3))
        os.replace(tmp_path / "other.json", cache.path)
    else:
        cache.path.write_text(content.replace('"K"', f'"{cache.key}"'), encoding="latin-1")
    classify = CountingClassify()
    lookup = _lookup(cache, classify)
    assert classify.calls > 0 and not lookup.from_cache and lookup.path == cache.path
    assert cache.load() == lookup.plan


def test_the_variable_turns_the_cache_off_without_writing(tmp_path, monkeypatch):
    saved = PlanCache(tmp_path, _key().digest())
    saved.save(WarmupPlan([1], [101], [1, 16], 3))
    before = saved.path.read_text()
    monkeypatch.setenv(ENABLE_ENV, "0")
    classify = CountingClassify()
    lookup = _lookup(saved, classify)
    assert classify.calls > 0 and not lookup.from_cache and lookup.path is None
    assert saved.path.read_text() == before
    _lookup(PlanCache(tmp_path / "empty", "k"), classify)
    assert not (tmp_path / "empty").exists() and "not saved" in lookup.describe()
    assert not plan_cache_applies(torch.device("cuda"))


def _blocked_by_a_file(tmp_path: Path) -> Path:
    (tmp_path / "file").write_text("")
    return tmp_path / "file" / "plans"


def _read_only(tmp_path: Path) -> Path:
    if os.geteuid() == 0:
        pytest.skip("root writes into read-only folders")
    tmp_path.chmod(0o500)
    return tmp_path


@pytest.mark.parametrize("folder", [_blocked_by_a_file, _read_only])
def test_a_write_error_is_a_warning_and_the_start_goes_on(tmp_path, folder, caplog):
    cache = PlanCache(folder(tmp_path), _key().digest())
    with caplog.at_level(logging.WARNING, logger="compute_service.warmup_plan_cache"):
        lookup = _lookup(cache, CountingClassify())
    tmp_path.chmod(0o700)
    assert lookup.plan.prefill_tokens == [101, 112, 251, 256] and lookup.path is None
    assert f"could not save the plan to {cache.path}" in caplog.text
    assert not cache.path.exists() and [p.name for p in tmp_path.iterdir()] in ([], ["file"])


def test_the_source_digest_follows_every_file_and_its_name(tmp_path):
    root = tmp_path / "kernels"
    (root / "sub").mkdir(parents=True)
    (root / "a.py").write_text("BLOCK_M = 16\n")
    (root / "sub" / "b.py").write_text("x = 1\n")
    (root / "notes.txt").write_text("not code")
    digests = [source_digest([root])]
    (root / "notes.txt").write_text("still not code")
    assert source_digest([root]) == digests[0]
    (root / "a.py").write_text("BLOCK_M = 32\n")
    digests.append(source_digest([root]))
    (root / "c.py").write_text("")
    digests.append(source_digest([root]))
    (root / "sub" / "b.py").rename(root / "sub" / "d.py")
    digests.append(source_digest([root]))
    assert len(set(digests)) == 4


def test_the_folder_is_beside_the_triton_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "tc"))
    assert plan_cache_dir() == tmp_path / "tc" / "loraplex-warmup-plans"
    monkeypatch.delenv("TRITON_CACHE_DIR")
    assert plan_cache_dir().parts[-3:] == (".triton", "cache", "loraplex-warmup-plans")


def test_without_triton_settings_the_folder_follows_the_variable_or_home(tmp_path, monkeypatch):
    import triton

    monkeypatch.delattr(triton, "knobs", raising=False)
    monkeypatch.setitem(sys.modules, "triton.knobs", None)     # a Triton without `knobs`
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "tc"))
    assert plan_cache_dir() == tmp_path / "tc" / "loraplex-warmup-plans"
    monkeypatch.delenv("TRITON_CACHE_DIR")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert plan_cache_dir() == tmp_path / ".triton" / "cache" / "loraplex-warmup-plans"


def test_only_cuda_with_recorded_launch_keys_keeps_a_plan(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv(ENABLE_ENV, raising=False)
    assert plan_cache_applies(torch.device("cuda")) and not plan_cache_applies(torch.device("cpu"))
    monkeypatch.setenv("TRITON_INTERPRET", "1")       # the interpreter records no launch keys
    assert not plan_cache_applies(torch.device("cuda"))


def test_a_cpu_start_neither_reads_nor_writes_the_cache(tiny_model_dir, tmp_path, monkeypatch):
    from compute_service.build import build_runtime
    from compute_service.config import ComputeConfig
    from compute_service.warmup import _plan

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    cfg = ComputeConfig(model=str(tiny_model_dir), device="cpu", max_model_len=96, kv_cache_bytes=1 << 20,
                        lora_gpu_cache_bytes=8 << 20, max_lora_rank=64)
    rt = build_runtime(cfg, None, capture_graphs=False)
    lookup = _plan(rt, [], [])
    assert not lookup.from_cache and lookup.path is None and lookup.plan.num_classes >= 1
    assert not any(tmp_path.iterdir())


def test_the_kernel_switches_are_part_of_the_key(monkeypatch):
    """A start with LORAPLEX_FP16_PAIRS=0 (or another switch that changes the launches) does not reuse the plan of
    a start without it."""
    from compute_service.warmup_plan_cache import switch_names, switch_parts

    assert {"LORAPLEX_PDL", "LORAPLEX_FP16_PAIRS", "LORAPLEX_H2_TMA", "LORAPLEX_TILE_TMA",
            "LORAPLEX_ASYNC_DOTS", "LORAPLEX_ASYNC_DOTS_SYNC",
            "LORAPLEX_ASYNC_DOTS_ONE_ROW", "LORAPLEX_DEFER_SPLIT"} <= set(switch_names())
    for name in switch_names():
        monkeypatch.delenv(name, raising=False)
    plain = switch_parts()
    monkeypatch.setenv("LORAPLEX_FP16_PAIRS", "0")
    assert "LORAPLEX_FP16_PAIRS=0" in switch_parts() and switch_parts() != plain
    assert _key(switches=switch_parts()).digest() != _key(switches=plain).digest()
