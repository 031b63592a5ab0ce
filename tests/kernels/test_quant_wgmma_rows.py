"""The many-row asynchronous-dot 4-bit kernel (`kernels.quant_wgmma_rows`, picked only with LORAPLEX_ASYNC_ROWS=1):
compiled for Hopper with no GPU, no spills at 64-128 rows with one or two warpgroups, each half block's 8
tensor-core instructions back to back with one group left running; the launcher and quant_matmul refuse what it
cannot do; pick_config's rule and the switch; on a GPU, the fp32 dequantize-then-matmul reference (masked rows and
features, a bias, groups of 128 and 256, 64-256-row tiles, loop steps of 2 and 4 half blocks) and QuantLinear
taking it when asked."""
from __future__ import annotations

import pytest
import torch
from test_quant_wgmma import TOOLS, check_dots_in_flight, sass


@pytest.mark.skipif(not (TOOLS / "cuobjdump").exists(), reason="Triton's CUDA tools are not installed")
@pytest.mark.parametrize("block_m,block_n,nx,u,split", [(128, 128, 4, 2, 1), (128, 64, 3, 2, 1), (64, 64, 4, 2, 1),
                                                     (128, 128, 4, 4, 1), (64, 64, 4, 4, 1), (128, 128, 4, 2, 2),
                                                     (64, 128, 4, 4, 4)])
def test_one_accumulator_and_a_dot_in_flight(block_m: int, block_n: int, nx: int, u: int, split: int,
                                             tmp_path) -> None:
    report, code = sass(tmp_path, "quant_wgmma_rows:quant_wgmma_rows_kernel", BLOCK_M=block_m, BLOCK_N=block_n,
                        NX=nx, U=u, SPLIT=split)
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
    with pytest.raises(ValueError, match="multiple of"):      # K = 1024: 8 half blocks, not 2 splits of 2 steps of 4
        quant_wgmma_rows(x, w, None, out, u=4, split=4)
    with pytest.raises(ValueError, match="partials"):
        quant_wgmma_rows(x, w, None, out, split=2)
    with pytest.raises(ValueError, match="partials"):
        quant_wgmma_rows(x, w, None, out, split=2, partials=torch.empty(2 * 128 * 128),
                         locks=torch.zeros(0, dtype=torch.int32))
    with pytest.raises(ValueError, match="sm_90"):             # on the CPU, or interpreted
        quant_wgmma_rows(x, w, None, out)
    with pytest.raises(ValueError, match="sm_90"):
        quant_wgmma_rows(x, w, None, out, split=2, partials=torch.empty(2 * 128 * 128),
                         locks=torch.zeros(1, dtype=torch.int32))


def test_pick_config_takes_it_at_65_to_255_rows_only_when_asked() -> None:
    """`async_rows` (LORAPLEX_ASYNC_ROWS, for A/B runs) with `async_dots`: 65-255 rows of a large 4-bit g128+
    weight with bfloat16 x take the many-row kernel (no sums of x); not at 64 or 256 rows, not without either
    flag, not for float16 x, small weights or groups of 32."""
    from kernels.quant_config import pick_config
    from kernels.quant_matmul import sums_width
    from kernels.quant_pack import pack_quantized

    for T, N, K in [(65, 6144, 4096), (128, 28672, 4096), (255, 4096, 14336)]:
        cfg = pick_config(T, N, K, 4, 132, 128, torch.bfloat16, async_dots=True, async_rows=True)
        assert cfg.scaled and cfg.ring and (cfg.block_m, cfg.block_n, cfg.split_k) == (128, 128, 1), cfg
        assert not pick_config(T, N, K, 4, 132, 128, torch.bfloat16, async_dots=True).scaled
        assert not pick_config(T, N, K, 4, 132, 128, torch.bfloat16, async_rows=True).scaled
    for T, N, K, group, dtype in [(64, 6144, 4096, 128, torch.bfloat16), (256, 6144, 4096, 128, torch.bfloat16),
                                  (128, 6144, 4096, 128, torch.float16), (128, 960, 576, 128, torch.bfloat16),
                                  (128, 6144, 4096, 32, torch.bfloat16)]:
        assert not pick_config(T, N, K, 4, 132, group, dtype, async_dots=True, async_rows=True).scaled, (T, N, K)
    cfg = pick_config(128, 6144, 4096, 4, 132, 128, torch.bfloat16, async_dots=True, async_rows=True)
    w = pack_quantized(torch.zeros(256, 1024, dtype=torch.uint8), torch.ones(256, 8).half(),
                       torch.zeros(256, 8).half(), 4, 128)
    assert sums_width(cfg, w, torch.bfloat16) == 0


def test_the_switch_is_read_from_the_environment(monkeypatch) -> None:
    from kernels.quant_wgmma_rows import ENV, async_rows_enabled

    monkeypatch.delenv(ENV, raising=False)
    assert not async_rows_enabled()
    monkeypatch.setenv(ENV, "1")
    assert async_rows_enabled()
    monkeypatch.setenv(ENV, "2")
    with pytest.raises(ValueError, match=ENV):
        async_rows_enabled()


def test_quant_matmul_refuses_it_where_it_cannot_run() -> None:
    """On the CPU (or interpreted) a scaled config is an error naming the kernel, not a silent fallback."""
    from kernels.quant_config import QuantMatmulConfig
    from kernels.quant_matmul import quant_matmul

    w, _ = _weight(128, 1024, 128)
    x = torch.randn(128, 1024).to(torch.bfloat16)
    out = torch.empty(128, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="many-row"):
        quant_matmul(x, w, None, out, QuantMatmulConfig(128, 128, 1, ring=4, ring_step=2, scaled=True))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="needs a CUDA GPU of sm_90 or later")
def test_gpu_quant_linear_takes_it_when_asked(monkeypatch) -> None:
    """LORAPLEX_ASYNC_ROWS=1: a QuantLinear at 100 rows runs the kernel (no sums asked of the writer) with a bias
    and matches the fp32 reference, and the tiles to rounding."""
    from compute_service.engine.quant_linear import QuantLinear
    from compute_service.engine.quantized import QuantizedWeight
    from kernels.quant_wgmma_rows import ENV

    monkeypatch.setenv(ENV, "1")
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(5)
    N, K, G, T = 4096, 4096, 128, 100
    q = torch.randint(0, 16, (N, K), dtype=torch.uint8, device=dev, generator=gen)
    s = (torch.rand(N, K // G, device=dev, generator=gen) * 0.01 + 1e-3).half()
    o = (-8 * s.float()).half()
    bias = torch.randn(N, device=dev, generator=gen) * 0.1
    lin = QuantLinear(QuantizedWeight(q, s, o, 4, G), bias=bias, device=dev)
    assert lin.async_rows and lin.sums_width(T, torch.bfloat16) == 0
    x = torch.randn(T, K, device=dev, generator=gen).to(torch.bfloat16)
    g = torch.arange(K, device=dev) // G
    want = x.float() @ (q.float() * s.float()[:, g] + o.float()[:, g]).t() + bias.to(torch.bfloat16).float()
    got = lin(x).float()
    assert ((got - want).norm() / want.norm()).item() < 1e-2
    lin.async_rows = False
    assert ((lin(x).float() - got).norm() / want.norm()).item() < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="needs a CUDA GPU of sm_90 or later")
@pytest.mark.parametrize("T,N,K,group", [(128, 256, 1024, 128), (100, 4160, 2048, 256), (255, 6144, 4096, 128),
                                         (64, 192, 1024, 128)])
@pytest.mark.parametrize("block_m,block_n,nx,u", [(128, 128, 4, 2), (128, 64, 3, 2), (64, 64, 4, 2), (256, 128, 3, 2),
                                               (128, 128, 4, 4), (64, 64, 3, 4)])
def test_gpu_matches_reference(T: int, N: int, K: int, group: int, block_m: int, block_n: int, nx: int,
                               u: int) -> None:
    from kernels.quant_wgmma_rows import quant_wgmma_rows

    dev = torch.device("cuda")
    w, dense = _weight(N, K, group, "cuda", T)
    gen = torch.Generator(device=dev).manual_seed(T + 1)
    x = torch.randn(T, K, device=dev, generator=gen).to(torch.bfloat16)
    bias = (torch.randn(N, device=dev, generator=gen) * 0.1).to(torch.bfloat16) if T % 2 == 0 else None
    want = x.float() @ dense.t() + (bias.float() if bias is not None else 0)
    out = torch.full((T, N), float("nan"), dtype=torch.bfloat16, device=dev)
    quant_wgmma_rows(x, w, bias, out, block_m=block_m, block_n=block_n, nx=nx, u=u)
    err = ((out.float() - want).norm() / want.norm()).item()
    assert err < 1e-2, err
    # the weights rounded to bfloat16 before the dot, as the dequantize-then-GEMM path does: close to that too
    close = x.float() @ dense.to(torch.bfloat16).float().t() + (bias.float() if bias is not None else 0)
    assert ((out.float() - close).norm() / close.norm()).item() < 4e-3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="needs a CUDA GPU of sm_90 or later")
@pytest.mark.parametrize("T,N,K,group", [(100, 4160, 2048, 256), (255, 4096, 4096, 128), (128, 192, 4096, 128)])
@pytest.mark.parametrize("block_m,block_n,nx,u,split", [(128, 128, 4, 2, 2), (64, 64, 4, 4, 4), (64, 128, 4, 4, 4),
                                                     (128, 64, 3, 2, 2)])
def test_gpu_split_k_matches_reference_and_repeats(T: int, N: int, K: int, group: int, block_m: int, block_n: int,
                                                   nx: int, u: int, split: int) -> None:
    """Split-K (quant_wgmma's protocol): the fp32 reference, the same bits on a second call, the locks left zero,
    masked rows and features."""
    import triton

    from kernels.quant_wgmma_rows import quant_wgmma_rows

    dev = torch.device("cuda")
    w, dense = _weight(N, K, group, "cuda", T)
    gen = torch.Generator(device=dev).manual_seed(T + 2)
    x = torch.randn(T, K, device=dev, generator=gen).to(torch.bfloat16)
    bias = (torch.randn(N, device=dev, generator=gen) * 0.1).to(torch.bfloat16)
    want = x.float() @ dense.t() + bias.float()
    partials = torch.full((split * T * N,), float("nan"), device=dev)
    locks = torch.zeros(triton.cdiv(T, block_m) * triton.cdiv(N, block_n), dtype=torch.int32, device=dev)
    outs = []
    for _ in range(2):
        out = torch.full((T, N), float("nan"), dtype=torch.bfloat16, device=dev)
        quant_wgmma_rows(x, w, bias, out, block_m, block_n, nx, u, split, partials, locks)
        outs.append(out)
    err = ((outs[0].float() - want).norm() / want.norm()).item()
    assert err < 1e-2, err
    assert torch.equal(outs[0], outs[1])
    assert not locks.any()
