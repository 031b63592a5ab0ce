"""A warm restart reads every Triton program from the cache the first start left: nothing is compiled again.

Each start runs in its own process, as a restarted service does, so the kernels' cache keys are computed afresh
(in whatever order that start's threads first launch them: a key that depended on that order sent a restart to
compile again, tests/kernels/test_cache_keys.py)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHILD = Path(__file__).with_name("warm_restart_child.py")


def _start(model: Path, cache: Path) -> dict:
    env = dict(os.environ, TRITON_CACHE_DIR=str(cache),
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    done = subprocess.run([sys.executable, str(CHILD), str(model), "keep"], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _programs(cache: Path) -> set[str]:
    return {str(p.relative_to(cache)) for p in cache.rglob("*.cubin")}


@pytest.mark.gpu
def test_a_warm_restart_compiles_no_program(tiny_model_dir, tmp_path):
    """A 4-bit base with adapters (the warm-up's own): its quantized, LoRA and attention kernels, CUDA graphs."""
    from compute_service.engine.quant_formats.export import quantize_checkpoint

    model = quantize_checkpoint(tiny_model_dir, tmp_path / "w4", bits=4, group_size=32, progress=False).out
    cache = tmp_path / "triton"
    first = _start(model, cache)
    programs = _programs(cache)
    assert first["pool"] and len(programs) > 10           # a cold start: its programs compiled by the workers
    second = _start(model, cache)
    assert not second["pool"]                             # the restart found its saved plan (a warm cache)
    assert _programs(cache) == programs                   # and compiled no program again
    assert second["compiled_kernels"] == first["compiled_kernels"]
