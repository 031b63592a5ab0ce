"""The many-row asynchronous-dot 4-bit kernel (`kernels.quant_wgmma_rows`, not picked by pick_config yet): compiled
for Hopper with no GPU, no spills at 64-128 rows with one or two warpgroups, each half block's 8 tensor-core
instructions back to back with one group left running; the launcher refuses what it cannot do; on a GPU, the fp32
dequantize-then-matmul reference (masked rows and features, a bias, groups of 128 and 256, 64-256-row tiles)."""
from __future__ import annotations

import pytest
import torch
from test_quant_wgmma import TOOLS, check_dots_in_flight, sass


@pytest.mark.skipif(not (TOOLS / "cuobjdump").exists(), reason="Triton's CUDA tools are not installed")
@pytest.mark.parametrize("block_m,block_n,nx", [(128, 128, 4), (128, 64, 3), (64, 64, 4)])
def test_one_accumulator_and_a_dot_in_flight(block_m: int, block_n: int, nx: int, tmp_path) -> None:
    report, code = sass(tmp_path, "quant_wgmma_rows:quant_wgmma_rows_kernel", BLOCK_M=block_m, BLOCK_N=block_n,
                        NX=nx)
    assert "stack (spills) 0 B" in report, report.splitlines()[0]
    check_dots_in_flight(code)


def _weight(N: int, K: int, group: int, device: str = "cpu", seed: int = 0):
    from kernels.quant_pack import pack_quantized

    gen = torch.Generator(device=device).manual_seed(seed)
    q = torch.randint(0, 16, (N, K), dtype=torch.uint8, device=device, generator=gen)
    s = (torch.rand(N, K // group, device=device, generator=gen) * 0.01 + 1e-3).half()
    o = (-8 * s.float() + torch.randn(N, K // group, device=device, generator=gen) * 1e-3).half()
    g = torch.arange(K, device=device) // group
    return pack_quantized(q, s, o, 4, group), q.float() * s.float()[:, g] + o.float()[:, g]


def test_the_launcher_refuses_what_the_kernel_cannot_do() -> None:
    from kernels.quant_wgmma_rows import quant_wgmma_rows

    w, _ = _weight(128, 1024, 128)
    x = torch.randn(128, 1024).to(torch.bfloat16)
    out = torch.empty(128, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="bfloat16"):
        quant_wgmma_rows(x.half(), w, None, out.half())
    with pytest.raises(ValueError, match="block_m"):
        quant_wgmma_rows(x, w, None, out, block_m=32)
    with pytest.raises(ValueError, match="multiple of"):
        quant_wgmma_rows(x[:, :640], _weight(128, 640, 128)[0], None, out)
    with pytest.raises(ValueError, match="sm_90"):             # on the CPU, or interpreted
        quant_wgmma_rows(x, w, None, out)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="needs a CUDA GPU of sm_90 or later")
@pytest.mark.parametrize("T,N,K,group", [(128, 256, 1024, 128), (100, 4160, 2048, 256), (255, 6144, 4096, 128),
                                         (64, 192, 1024, 128)])
@pytest.mark.parametrize("block_m,block_n,nx", [(128, 128, 4), (128, 64, 3), (64, 64, 4), (256, 128, 3)])
def test_gpu_matches_reference(T: int, N: int, K: int, group: int, block_m: int, block_n: int, nx: int) -> None:
    from kernels.quant_wgmma_rows import quant_wgmma_rows

    dev = torch.device("cuda")
    w, dense = _weight(N, K, group, "cuda", T)
    gen = torch.Generator(device=dev).manual_seed(T + 1)
    x = torch.randn(T, K, device=dev, generator=gen).to(torch.bfloat16)
    bias = (torch.randn(N, device=dev, generator=gen) * 0.1).to(torch.bfloat16) if T % 2 == 0 else None
    want = x.float() @ dense.t() + (bias.float() if bias is not None else 0)
    out = torch.full((T, N), float("nan"), dtype=torch.bfloat16, device=dev)
    quant_wgmma_rows(x, w, bias, out, block_m=block_m, block_n=block_n, nx=nx)
    err = ((out.float() - want).norm() / want.norm()).item()
    assert err < 1e-2, err
    # the weights rounded to bfloat16 before the dot, as the dequantize-then-GEMM path does: close to that too
    close = x.float() @ dense.to(torch.bfloat16).float().t() + (bias.float() if bias is not None else 0)
    assert ((out.float() - close).norm() / close.norm()).item() < 4e-3
