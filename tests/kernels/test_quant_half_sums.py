"""Sums of x over 128-wide halves (the pair-codes path's offsets term) or 32-wide groups (groups of 32) against
torch, and its input checks."""
import pytest
import torch

from kernels.quant_half_sums import half_sums_into

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("T,K,width", [(1, 128, 128), (3, 640, 128), (5, 4608, 128),   # 1, 5, 36 halves
                                        (2, 96, 32), (3, 1056, 32)])       # groups of 32: 3 and 33 slices
def test_half_sums_match_torch(T: int, K: int, width: int) -> None:
    gen = torch.Generator().manual_seed(T * K)
    x = torch.randn(T, K + 64, generator=gen).half().to(DEVICE)[:, :K]     # rows strided past K
    out = torch.full((T, K // width), float("nan"), device=DEVICE)
    half_sums_into(x, out, width)
    want = x.float().reshape(T, K // width, width).sum(-1)
    assert torch.allclose(out, want, rtol=1e-5, atol=1e-4)


def test_half_sums_check_inputs() -> None:
    x = torch.zeros(2, 200, dtype=torch.float16, device=DEVICE)
    with pytest.raises(ValueError, match="K % 128"):
        half_sums_into(x, torch.zeros(2, 1, device=DEVICE))
    with pytest.raises(ValueError, match="width 32 or 128"):
        half_sums_into(x[:, :128], torch.zeros(2, 2, device=DEVICE), 64)
    with pytest.raises(ValueError, match="float32"):
        half_sums_into(x[:, :128], torch.zeros(2, 1, dtype=torch.float16, device=DEVICE))


@pytest.mark.parametrize("T,H,width", [(3, 640, 128), (2, 96, 32)])
def test_the_norm_writes_its_outputs_slice_sums(T: int, H: int, width: int) -> None:
    """The norm that writes a quantized projection's x writes x's slice sums too (no launch of their own between
    it and the projection), equal to the sums of its output as stored."""
    from kernels.rms_norm import add_rms_norm

    gen = torch.Generator().manual_seed(T * H)
    x, r = (torch.randn(T, H, generator=gen).half().to(DEVICE) for _ in range(2))
    w = (1 + 0.2 * torch.randn(H, generator=gen)).half().to(DEVICE)
    out, h = torch.empty_like(x), torch.empty_like(x)
    sums = torch.full((T, H // width), float("nan"), device=DEVICE)
    add_rms_norm(x, r, w, 1e-5, out, h, sums)
    assert torch.allclose(sums, out.float().reshape(T, H // width, width).sum(-1), rtol=1e-5, atol=1e-4)
    plain = torch.empty_like(x)
    add_rms_norm(x, r, w, 1e-5, plain, torch.empty_like(x))
    assert torch.equal(plain, out)                                  # the sums change nothing else
    with pytest.raises(ValueError, match="width 32 or 128"):
        add_rms_norm(x, r, w, 1e-5, out, h, torch.zeros(T, H // 16, device=DEVICE))


@pytest.mark.parametrize("T,inter,width", [(2, 1280, 128), (3, 96, 32)])   # 2 programs, the second partial; 1
def test_swiglu_writes_its_outputs_slice_sums(T: int, inter: int, width: int) -> None:
    from kernels.silu_mul import silu_mul

    gen = torch.Generator().manual_seed(T * inter)
    gu = torch.randn(T, 2 * inter, generator=gen).half().to(DEVICE)
    out = torch.empty(T, inter, dtype=torch.float16, device=DEVICE)
    sums = torch.full((T, inter // width), float("nan"), device=DEVICE)
    silu_mul(gu, out, sums)
    assert torch.allclose(sums, out.float().reshape(T, inter // width, width).sum(-1), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("group", [128, 32])
def test_the_quantized_matmul_reads_given_sums_instead_of_its_own(group: int) -> None:
    """Given x's slice sums, the pair-codes path reads them (wrong sums give a wrong result) and, given the
    right ones, equals the call that computes them itself."""
    from kernels.quant_matmul import QuantMatmulConfig, quant_matmul, sums_width
    from kernels.quant_pack import pack_quantized

    gen = torch.Generator().manual_seed(group)
    T, N, K = 5, 32, 512
    q = torch.randint(0, 16, (N, K), dtype=torch.uint8, generator=gen).to(DEVICE)
    s = (torch.rand(N, K // group, generator=gen) * 0.02 + 0.002).half().to(DEVICE)
    o = (-torch.rand(N, K // group, generator=gen) * 0.16).half().to(DEVICE)
    w = pack_quantized(q, s, o, 4, group)
    x = torch.randn(T, K, generator=gen).half().to(DEVICE)
    cfg = QuantMatmulConfig(block_n=16, block_m=16, split_k=1)
    width = sums_width(cfg, w, x.dtype)
    assert width == (128 if group == 128 else 32) and sums_width(cfg, w, torch.float32) == 0
    own, given, wrong = (torch.full((T, N), float("nan"), dtype=x.dtype, device=DEVICE) for _ in range(3))
    quant_matmul(x, w, None, own, cfg)
    quant_matmul(x, w, None, given, cfg, x_sums=x.float().reshape(T, K // width, width).sum(-1).contiguous())
    quant_matmul(x, w, None, wrong, cfg, x_sums=torch.zeros(T, K // width, device=DEVICE))
    assert torch.allclose(given.float(), own.float(), rtol=1e-3, atol=1e-3)
    assert not torch.allclose(wrong.float(), own.float(), rtol=1e-2, atol=1e-2)
    with pytest.raises(ValueError, match="x_sums must be"):
        quant_matmul(x, w, None, own, cfg, x_sums=torch.zeros(T, 3, device=DEVICE))


@pytest.mark.gpu
def test_gpu_sums_written_with_x_on_the_8b_shapes() -> None:
    """Compiled, bfloat16, the 8B's widths: the norm's and the SwiGLU's sums equal their outputs' (halves of 128),
    and q/k/v's pair-codes tiles at 8 rows given them equal the same call summing x itself."""
    from kernels.quant_matmul import pick_config, quant_matmul, sums_width
    from kernels.quant_pack import pack_quantized
    from kernels.rms_norm import add_rms_norm
    from kernels.silu_mul import silu_mul

    gen = torch.Generator().manual_seed(8)
    T, H, inter = 8, 4096, 14336
    x, r = (torch.randn(T, H, generator=gen).bfloat16().cuda() for _ in range(2))
    w = (1 + 0.2 * torch.randn(H, generator=gen)).bfloat16().cuda()
    out, h = torch.empty_like(x), torch.empty_like(x)
    sums = torch.full((T, H // 128), float("nan"), device="cuda")
    add_rms_norm(x, r, w, 1e-5, out, h, sums)
    assert torch.allclose(sums, out.float().reshape(T, -1, 128).sum(-1), rtol=1e-4, atol=1e-3)
    gu = torch.randn(T, 2 * inter, generator=gen).bfloat16().cuda()
    act = torch.empty(T, inter, dtype=torch.bfloat16, device="cuda")
    act_sums = torch.full((T, inter // 128), float("nan"), device="cuda")
    silu_mul(gu, act, act_sums)
    assert torch.allclose(act_sums, act.float().reshape(T, -1, 128).sum(-1), rtol=1e-4, atol=1e-3)
    N = 6144
    q = torch.randint(0, 16, (N, H), dtype=torch.uint8, generator=gen).cuda()
    s = (torch.rand(N, H // 128, generator=gen) * 0.02 + 0.002).half().cuda()
    o = (-torch.rand(N, H // 128, generator=gen) * 0.16).half().cuda()
    wq = pack_quantized(q, s, o, 4, 128)
    cfg = pick_config(T, N, H, 4, torch.cuda.get_device_properties(0).multi_processor_count, 128, torch.bfloat16)
    assert sums_width(cfg, wq, torch.bfloat16) == 128
    locks = torch.zeros(4 * N // 16, dtype=torch.int32, device="cuda")
    partials = torch.empty(cfg.split_k * T * N, device="cuda")
    own, given = (torch.full((T, N), float("nan"), dtype=torch.bfloat16, device="cuda") for _ in range(2))
    quant_matmul(out, wq, None, own, cfg, partials, locks)
    quant_matmul(out, wq, None, given, cfg, partials, locks, x_sums=sums)
    assert torch.allclose(given.float(), own.float(), rtol=1e-2, atol=1e-2)
