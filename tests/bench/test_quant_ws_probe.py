"""bench/quant_ws_probe.py and its kernels (bench/quant_ws_kernels.py): the warp-role kernels compile for sm_90 with
their roles, barriers and copies (CPU), compute the product (GPU), and the loads-alone kernel reads every word
(the interpreter)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

from kernels.quant_dequant import dequantize_packed  # noqa: E402
from kernels.quant_pack import pack_quantized  # noqa: E402


def _ptx(tmp_path: Path, kind: str, sub: int = 1) -> str:
    out = tmp_path / f"{kind}{sub}.ptx"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "quant_ws_probe.py"), "--compile-only", kind,
                           "--sub", str(sub), "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out.read_text()


@pytest.mark.parametrize("sub", [1, 2])
def test_tma_kernel_compiles_with_a_copy_warp(tmp_path, sub):
    """The TMA kernel: its copy warp gives up registers to the compute warps, its three copies a slot are tensor
    copies completing on a memory barrier, and the compute warps run the float16-pairs chains (16 a row's quad
    of words) once per block of the box."""
    ptx = _ptx(tmp_path, "tma", sub)
    assert "setmaxnreg.dec.sync.aligned.u32 \t24" in ptx and "setmaxnreg.inc" in ptx
    assert ptx.count("cp.async.bulk.tensor.2d") == 3 and "mbarrier.try_wait" in ptx
    assert ptx.count("fma.rn.f16x2") == 128 * sub


def test_regs_kernel_compiles_with_copy_warps_storing_into_the_ring(tmp_path):
    ptx = _ptx(tmp_path, "regs")
    assert "setmaxnreg.dec.sync.aligned.u32 \t96" in ptx or "setmaxnreg.inc.sync.aligned.u32 \t96" in ptx
    assert "cp.async.bulk.tensor" not in ptx and "st.shared" in ptx and "mbarrier.try_wait" in ptx


def _weight(n: int, k: int, device: str):
    gen = torch.Generator(device=device).manual_seed(0)
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, device=device, generator=gen)
    s = (torch.rand(n, k // 128, device=device, generator=gen) * 0.01 + 1e-3).half()
    return pack_quantized(q, s, (-8 * s.float()).half(), 4, 128), gen


def test_loads_kernel_reads_every_word():
    """Each program folds its blocks' words by xor; the stored row value is the sum of that fold over 32 words."""
    from quant_ws_kernels import loads_kernel
    w, _ = _weight(64, 1024, "cpu")
    n, nb = 64, 4
    out = torch.empty(n, dtype=torch.int32)
    for split in (1, 2):
        loads_kernel[(n // 32, split)](w.words, out, w.words.shape[1], nb // split, 32, 1)
        blocks = w.words.view(n, nb, 32)[:, (split - 1) * (nb // split):]      # the last split's blocks
        fold = blocks[:, 0]
        for b in range(1, blocks.shape[1]):
            fold = fold ^ blocks[:, b]
        want = fold.to(torch.int64).sum(1)
        want = ((want + 2**31) % 2**32 - 2**31).to(torch.int32)
        assert torch.equal(out, want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9, reason="sm_90+")
@pytest.mark.parametrize("kind,cfg", [("tma", dict(split=2, stages=2, programs=3, sub=1, rot=0)),
                                      ("tma", dict(split=1, stages=3, programs=2, sub=2, rot=1)),
                                      ("regs", dict(split=2, stages=2, programs=3, ahead=1)),
                                      ("regs", dict(split=4, stages=3, programs=5, ahead=0))])
def test_gpu_warp_role_kernels_compute_the_product(kind, cfg):
    """Against the fp32 product of the dequantized weight, to the float16-pairs rounding, with more units than
    programs (a program's copies run on across its units)."""
    from quant_ws_probe import regs_launch, tma_launch
    w, gen = _weight(512, 2048, "cuda")
    x = torch.randn(2048, device="cuda", generator=gen).to(torch.bfloat16)
    w0 = torch.empty(512, 2048, device="cuda")
    dequantize_packed(w, w0)
    want = x.float() @ w0.t()
    part = torch.full((cfg["split"], 512), float("nan"), device="cuda")
    (tma_launch if kind == "tma" else regs_launch)(x, w, part, **cfg)
    got = part.sum(0)
    assert ((got - want).norm() / want.norm()).item() < 1e-2
