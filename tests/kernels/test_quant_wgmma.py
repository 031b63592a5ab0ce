"""The asynchronous-dot 4-bit tiles (`kernels.quant_wgmma`, an experiment quant_matmul does not call): compiled for
Hopper with no GPU, each half block's 8 tensor-core instructions issue back to back and the program waits for all
but the latest group (two dots in flight), never after each instruction (what the assembler does when a running
dot's accumulators are read or copied); the launcher refuses what the kernel cannot do; on a GPU, the
fp32 dequantize-then-matmul reference (tiles with masked rows and features, split-K, groups of 128 and 256)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
TOOLS = Path(__import__("triton").__file__).parent / "backends" / "nvidia" / "bin"
sys.path.insert(0, str(ROOT / "scripts"))


def sass(block_m: int, split: int, tmp_path: Path) -> tuple[str, list[tuple[int, str, str]]]:
    """(kernel_sass.py's report, the machine code) of the kernel compiled for sm_90."""
    from kernel_sass import parse_sass

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / f"bm{block_m}_split{split}"
    cmd = [sys.executable, str(ROOT / "scripts" / "kernel_sass.py"), "kernels.quant_wgmma:quant_wgmma_kernel",
           "--const", "GROUP=128", f"BLOCK_M={block_m}", "NX=4", "U=4", f"SPLIT={split}",
           "--ptr", "x_ptr=bf16", "w_ptr=i32", "s_ptr=fp16", "o_ptr=fp16", "xs_ptr=fp32", "out_ptr=bf16",
           "part_ptr=fp32", "--aligned", "N", "stride_x", "stride_out", "words_per_row", "--dump", str(out)]
    run = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    return run.stdout, parse_sass((out / "kernel.sass").read_text())


@pytest.mark.skipif(not (TOOLS / "cuobjdump").exists(), reason="Triton's CUDA tools are not installed")
@pytest.mark.parametrize("block_m,split", [(16, 1), (32, 2)])
def test_two_dots_in_flight(block_m: int, split: int, tmp_path: Path) -> None:
    report, code = sass(block_m, split, tmp_path)
    if block_m == 16:
        assert "stack (spills) 0 B" in report, report.splitlines()[0]
    ops = [op for _, op, _ in code]
    groups, current = [], []
    for op, (_, _, args) in zip(ops, code):
        if op.startswith("HGMMA"):
            current.append(op)
            if "gsb0" in args:                  # the group's last instruction
                groups.append(current)
                current = []
    assert groups and all(len(g) == 8 for g in groups), [len(g) for g in groups]   # K = 128: 8 x k16
    first = ops.index(next(op for op in ops if op.startswith("HGMMA")))
    between = []                               # waits between two instructions of one group
    seen = 0
    for op, (_, _, args) in zip(ops[first:], code[first:]):
        if op.startswith("HGMMA"):
            seen = 0 if "gsb0" in args else 1
        elif seen and op.startswith("WARPGROUP.DEPBAR"):
            between.append(op)
    assert not between, f"the assembler waits inside a dot's group: {between[:4]}"
    waits = [args.strip() for (_, op, args) in code if op.startswith("WARPGROUP.DEPBAR")]
    assert any(w.endswith("0x1") for w in waits), waits           # one group left running while the next issues


def test_the_launcher_refuses_what_the_kernel_cannot_do() -> None:
    from kernels.quant_pack import pack_quantized
    from kernels.quant_wgmma import quant_wgmma

    gen = torch.Generator().manual_seed(0)

    def weight(K: int, group: int, bits: int = 4):
        q = torch.randint(0, 2**bits, (64, K), dtype=torch.uint8, generator=gen)
        s = (torch.rand(64, K // group, generator=gen) * 0.01 + 1e-3).half()
        return pack_quantized(q, s, (-8 * s.float()).half(), bits, group)

    x = torch.randn(8, 512).to(torch.bfloat16)
    out = torch.empty(8, 64, dtype=torch.bfloat16)
    sums = torch.zeros(8, 4)
    with pytest.raises(ValueError, match="bfloat16"):
        quant_wgmma(x.half(), weight(512, 128), out, sums)
    with pytest.raises(ValueError, match="groups of 128"):
        quant_wgmma(x, weight(512, 32), out, sums)
    with pytest.raises(ValueError, match="multiple of 1024"):
        quant_wgmma(x, weight(512, 128), out, sums, split=2)
    with pytest.raises(ValueError, match="block_m"):
        quant_wgmma(x, weight(512, 128), out, sums, block_m=8)
    with pytest.raises(ValueError, match="partials"):
        quant_wgmma(torch.randn(8, 1024).to(torch.bfloat16), weight(1024, 128), out, torch.zeros(8, 8), split=2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="needs a CUDA GPU of sm_90 or later")
@pytest.mark.parametrize("T,N,K,group,block_m,split", [(16, 128, 1024, 128, 16, 1), (20, 96, 2048, 256, 32, 2),
                                                       (32, 6144, 4096, 128, 32, 1), (64, 4096, 14336, 128, 32, 4)])
def test_gpu_matches_reference(T: int, N: int, K: int, group: int, block_m: int, split: int) -> None:
    from kernels.quant_matmul import half_sums
    from kernels.quant_pack import pack_quantized
    from kernels.quant_wgmma import quant_wgmma

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(T * 7 + split)
    q = torch.randint(0, 16, (N, K), dtype=torch.uint8, device=dev, generator=gen)
    s = (torch.rand(N, K // group, device=dev, generator=gen) * 0.01 + 1e-3).half()
    o = (-8 * s.float() + torch.randn(N, K // group, device=dev, generator=gen) * 1e-3).half()
    w = pack_quantized(q, s, o, 4, group)
    x = torch.randn(T, K, device=dev, generator=gen).to(torch.bfloat16)
    g = torch.arange(K, device=dev) // group
    want = x.float() @ (q.float() * s.float()[:, g] + o.float()[:, g]).t()
    out = torch.full((T, N), float("nan"), dtype=torch.bfloat16, device=dev)
    partials = torch.zeros(T, N, device=dev) if split > 1 else None
    quant_wgmma(x, w, out, half_sums(x), block_m=block_m, split=split, partials=partials)
    got = out.float() if split == 1 else partials
    err = ((got - want).norm() / want.norm()).item()
    assert err < 1e-2, f"rel err {err}"
