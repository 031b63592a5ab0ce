"""The one-row base kernels that read x before their wait (an addend: kernels/pdl.py's exception) fence
first: compiled for Hopper with no GPU (scripts/kernel_sass.py), every thread's first global load comes
after the invalidation of the SM's L1, so no load is served by a line an earlier kernel left there; without
an addend there is no fence."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOOLS = Path(__import__("triton").__file__).parent / "backends" / "nvidia" / "bin"
pytestmark = pytest.mark.skipif(not (TOOLS / "cuobjdump").exists(), reason="Triton's CUDA tools are not installed")

QUANT = ["kernels.quant_gemv:quant_gemv_kernel", "--const", "GROUP=128", "BITS=4", "BLOCK_N=64", "SPLIT=0",
         "HAS_BIAS=0", "EVEN_K=1", "FENCE=1", "NUM_THREADS=128", "ASM=1", "USE_PDL=1", "PAIRED=1", "X32=1",
         "--ptr", "x_ptr=bf16", "w_ptr=i32", "s_ptr=fp16", "o_ptr=fp16", "bias_ptr=bf16", "out_ptr=bf16",
         "lock_ptr=i32", "--aligned", "N", "K", "stride_x", "stride_out", "words_per_row", "--warps", "4"]
DENSE = ["kernels.dense_gemv:_dense_gemv_kernel", "--const", "BLOCK_N=16", "BLOCK_K=512", "HAS_BIAS=0",
         "EVEN_K=1", "USE_PDL=1", "FENCE=1", "NUM_THREADS=256", "--ptr", "x_ptr=bf16", "w_ptr=bf16",
         "bias_ptr=bf16", "out_ptr=bf16", "--aligned", "N", "K", "stride_w", "--warps", "8"]


def opcodes(args: list[str], add: int, tmp_path: Path) -> list[str]:
    """The compiled kernel's opcodes in order (ADD=add)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / f"dump{add}"
    i = args.index("--ptr")
    cmd = [sys.executable, str(ROOT / "scripts" / "kernel_sass.py"), *args[:i], f"ADD={add}", *args[i:],
           "--dump", str(out)]
    run = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    sys.path.insert(0, str(ROOT / "scripts"))
    from kernel_sass import parse_sass
    return [op for _, op, _ in parse_sass((out / "kernel.sass").read_text())]


@pytest.mark.parametrize("args", [QUANT, DENSE], ids=["quant_gemv", "dense_gemv"])
def test_a_kernel_reading_x_before_its_wait_invalidates_l1_before_any_load(args, tmp_path):
    ops = opcodes(args, 1, tmp_path)
    loads = [i for i, op in enumerate(ops) if op.startswith("LDG")]
    fences = [i for i, op in enumerate(ops) if op.startswith("CCTL.IVALL")]
    assert loads and fences and fences[0] < loads[0], ops[:40]
    assert not [op for op in ops if op.startswith("LDG") and ".STRONG" in op], "x no longer needs to bypass L1"


def test_without_an_addend_the_one_row_kernel_does_not_fence(tmp_path):
    ops = opcodes(QUANT, 0, tmp_path)
    assert not [op for op in ops if op.startswith(("CCTL", "MEMBAR"))], [op for op in ops if "CCTL" in op]
