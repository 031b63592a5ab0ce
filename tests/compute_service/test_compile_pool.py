"""Compile worker processes for a cold start: what they are handed, failures left to the warm-up, the GPU path."""
from __future__ import annotations

import collections
import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from compute_service.compile_pool import CompilePool, default_processes, pool_applies
from compute_service.config import ComputeConfig
from compute_service.warmup_plan import LaunchRecorder
from loraplex.settings import SettingsError


def test_default_processes_leave_a_core_to_the_main_process():
    assert 1 <= default_processes() <= 16


def test_no_pool_on_the_cpu_or_under_the_interpreter(monkeypatch):
    assert not pool_applies("cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not pool_applies("cuda")


def test_compile_processes_setting_is_checked():
    assert ComputeConfig(compile_processes=-1).compile_processes == -1
    with pytest.raises(SettingsError, match="compile_processes"):
        ComputeConfig(compile_processes=-2)


def _info(name: str) -> SimpleNamespace:
    return SimpleNamespace(module="kernels.silu_mul", name=name)


def test_each_program_goes_to_a_worker_once_and_a_failure_is_counted_not_raised():
    pool = CompilePool(1)
    pool.set_target(("cuda", 90, 32))
    try:
        # The hook tells Triton to skip every launch it sees; a program it saw before is not handed over again.
        assert pool.hook(fn=_info("_silu_mul_kernel"), compile={"specialization_data": "{not json"}) is True
        assert pool.hook(fn=_info("_silu_mul_kernel"), compile={"specialization_data": "{not json"}) is True
        assert pool.hook(fn=_info("f.<locals>.g"), compile={"specialization_data": "{}"}) is True   # not importable
        assert pool.started and pool.report.programs == 1
        report = pool.wait()                      # the worker's error comes back as a count: the warm-up compiles it
    finally:
        pool.close()
    assert (report.programs, report.compiled, report.failed) == (1, 0, 1)
    assert "_silu_mul_kernel" in report.errors[0] and "JSONDecodeError" in report.errors[0]
    assert "1 left to the warm-up" in report.describe()
    assert not pool.started


def test_the_costliest_kernels_are_named_with_their_program_counts_and_seconds():
    from compute_service.compile_pool import PoolReport

    report = PoolReport(kernel_s={"_a": [1.0, 2.5], "_b": [6.0], "_c": [0.5, 0.5, 0.5], "_d": [0.1]})
    assert report.costliest(2) == "_b: 1 programs, 6.0 s (the longest 6.0 s), _a: 2 programs, 3.5 s (the longest 2.5 s)"
    assert PoolReport().costliest() == "none"


def test_a_pool_without_a_target_refuses_programs():
    with pytest.raises(RuntimeError, match="target"):
        CompilePool(1).submit("kernels.silu_mul", "_silu_mul_kernel", "{}")


def test_the_plan_recorder_passes_launches_on_to_a_hook_outside_it_unless_told_not_to():
    pytest.importorskip("triton")
    from triton import knobs

    seen = []
    old = knobs.runtime.jit_cache_hook
    knobs.runtime.jit_cache_hook = lambda *a, **kw: seen.append(kw["key"]) or True
    try:
        with LaunchRecorder() as rec:
            assert knobs.runtime.jit_cache_hook == rec._hook
            assert rec._hook(key="k1", repr="kernel") is True
        assert rec.keys == ["kernel|k1"] and seen == ["k1"]
        with LaunchRecorder(pass_on=False) as rec:         # the quantized dry runs: keys only
            assert rec._hook(key="k2", repr="kernel") is True
        assert rec.keys == ["kernel|k2"] and seen == ["k1"]
    finally:
        knobs.runtime.jit_cache_hook = old


def _note_lookup(seen: set[tuple[str, str]], kwargs: dict) -> bool:
    """A JIT cache hook that notes each program looked for and lets Triton go on (compile or read its cache)."""
    fn, spec = kwargs.get("fn"), (kwargs.get("compile") or {}).get("specialization_data")
    if fn is not None and spec is not None and "<locals>" not in fn.name:
        seen.add((fn.name, spec))
    return False


def _spec_fields(spec: str) -> dict[str, object]:
    data = json.loads(spec)
    fields = {f"const {k}": v for k, v in zip(map(tuple, data["constant_keys"]), data["constant_vals"])}
    fields.update({f"attr {k}": v for k, v in zip(map(tuple, data["attrs_keys"]), data["attrs_vals"])})
    fields.update({f"sig {k}": v for k, v in data["signature"].items()})
    fields.update({f"opt {k}": v for k, v in data["options"].items()})
    return fields


def _spec_difference(name: str, spec: str, handed: list[str]) -> str:
    """How a program differs from the nearest one of the same kernel that was handed to the pool."""
    mine = _spec_fields(spec)
    best: list[str] | None = None
    for other in map(_spec_fields, handed):
        diff = [f"{k}: {other.get(k)!r} -> {mine.get(k)!r}" for k in sorted(set(mine) | set(other), key=str)
                if mine.get(k) != other.get(k)]
        best = diff if best is None or len(diff) < len(best) else best
    return f"  {name}: " + ("no program of this kernel was handed over" if best is None else "; ".join(best))


def _forget_compiled_programs() -> None:
    """Drops the programs this process holds, so launches go through Triton's JIT hook again."""
    from compute_service.warmup import kernel_functions

    for fn in kernel_functions():
        for entry in fn.device_caches.values():
            entry[0].clear()


@pytest.fixture(scope="module")
def w4_mid_dir(tmp_path_factory) -> Path:
    """A 4-bit llama in groups of 128 whose gate/up and down take the asynchronous-dot kernel at 2-32 rows on an
    sm_90+ GPU (a kernel in Triton's explicit-layout dialect)."""
    from helpers import w4_mid_llama

    return w4_mid_llama(tmp_path_factory)[0]


@pytest.mark.gpu
@pytest.mark.parametrize("model", ["tiny", "w4_mid"])
def test_a_cold_start_compiles_in_workers_and_the_warm_up_reads_their_cache(model, request, tmp_path, monkeypatch):
    """Empty Triton cache (so no saved plan either): every program the warm-up needs is compiled once, by a
    worker; the warm-up's own launches then find each in the cache (no second copy of any program). The 4-bit
    model's kernels include one of the explicit-layout dialect on an sm_90+ GPU."""
    from triton import knobs

    from compute_service.build import build_runtime
    from compute_service.warmup import compiled_by_kernel, compiled_kernels, warm_up
    from kernels.quant_wgmma import runs_on

    folder = request.getfixturevalue("tiny_model_dir" if model == "tiny" else "w4_mid_dir")
    cache = tmp_path / "triton"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(cache))
    _forget_compiled_programs()
    cfg = ComputeConfig(model=str(folder), device="cuda", max_model_len=96, kv_cache_bytes=1 << 20,
                        lora_gpu_cache_bytes=(8 if model == "tiny" else 64) << 20,   # a few of the 4-bit's slots
                        max_lora_rank=64, max_num_batched_tokens=256)
    rt = build_runtime(cfg, None, capture_graphs=False)
    looked_up: set[tuple[str, str]] = set()       # programs the main process looked for outside the recordings
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", lambda *a, **kw: _note_lookup(looked_up, kw))
    handed: set[tuple[str, str]] = set()           # programs the recordings handed to the pool
    submit = CompilePool.submit
    monkeypatch.setattr(CompilePool, "submit", lambda self, module, qualname, spec: handed.add((qualname, spec))
                        or submit(self, module, qualname, spec))
    report = warm_up(rt, "full", compile_processes=4)
    pool = report.pool
    assert pool is not None and pool.processes == 4
    assert pool.programs > 10 and pool.compiled == pool.programs and pool.failed == 0, pool.errors
    outside = sorted(looked_up - handed)
    assert not outside, f"{len(outside)} programs the recordings did not hand over:\n" + "\n".join(
        _spec_difference(name, spec, [s for q, s in handed if q == name]) for name, spec in outside)
    assert sum(len(ts) for ts in pool.kernel_s.values()) == pool.compiled and "programs" in pool.costliest()
    cubins = list(Path(cache).rglob("*.cubin"))
    assert len(cubins) == pool.programs                 # the warm-up compiled no program again
    held = compiled_by_kernel() or collections.Counter()  # and every program handed over is one it runs
    handed_by_kernel = collections.Counter(name for name, _ in handed)
    assert compiled_kernels() == pool.programs, "programs handed over / held, by kernel: " + ", ".join(
        f"{name} {handed_by_kernel[name]} / {held[name]}" for name in sorted(set(held) | set(handed_by_kernel))
        if handed_by_kernel[name] != held[name])
    if model == "w4_mid" and runs_on(torch.device("cuda")):
        assert "quant_wgmma_kernel" in pool.kernel_s, sorted(pool.kernel_s)
    torch.cuda.synchronize()



def test_a_program_not_done_in_time_is_left_to_the_warm_up():
    pool = CompilePool(1)
    pool.set_target(("cuda", 90, 32))
    try:
        pool.submit("kernels.silu_mul", "_silu_mul_kernel", "{}")
        report = pool.wait(timeout_s=0.0)         # the worker is still starting: nothing can be done yet
    finally:
        pool.close()
    assert (report.programs, report.compiled, report.failed) == (1, 0, 1)
    assert "TimeoutError" in report.errors[0] and "within 0 s" in report.errors[0]


ROOT = Path(__file__).resolve().parents[2]
# Compiled for sm_90 with Triton's own assembler: a worker never touches the GPU, so no GPU is needed here.
WORKER_COMPILE = """
import json, sys
sys.path.insert(0, "scripts")
from kernel_sass import specialization
from kernels.quant_wgmma import quant_wgmma_kernel
from compute_service.compile_pool import compile_program

sig, constexprs, attrs = specialization(
    quant_wgmma_kernel, {"GROUP": 128, "BLOCK_M": 16, "NX": 4, "U": 4, "SPLIT": 1, "HAS_BIAS": 0, "FENCE": 1,
                         "USE_PDL": 1},
    {"x_ptr": "bf16", "w_ptr": "i32", "s_ptr": "fp16", "o_ptr": "fp16", "xs_ptr": "fp32", "bias_ptr": "bf16",
     "out_ptr": "bf16", "part_ptr": "fp32", "lock_ptr": "i32"},
    {"N", "stride_x", "stride_out", "words_per_row"})
spec = json.dumps({"signature": sig, "constant_keys": [list(k) for k in constexprs],
                   "constant_vals": [{"constexpr": v} for v in constexprs.values()],
                   "attrs_keys": [list(k) for k in attrs], "attrs_vals": list(attrs.values()),
                   "options": {"num_warps": 4, "num_stages": 3}})
compile_program("kernels.quant_wgmma", "quant_wgmma_kernel", spec, ("cuda", 90, 32))
"""


@pytest.mark.skipif(not (Path(__import__("triton").__file__).parent / "backends" / "nvidia" / "bin" / "ptxas")
                    .exists(), reason="Triton's CUDA assembler is not installed")
def test_a_worker_compiles_a_kernel_of_the_explicit_layout_dialect(tmp_path):
    # The asynchronous-dot 4-bit kernel is written in Triton's explicit-layout dialect: parsed as plain Triton
    # source it fails, and every such program was left to the warm-up's main process, one at a time.
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}   # compiled, not interpreted
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    run = subprocess.run([sys.executable, "-c", WORKER_COMPILE], capture_output=True, text=True, env=env,
                         timeout=600, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    assert [p.name for p in tmp_path.rglob("*.cubin")] == ["quant_wgmma_kernel.cubin"]
