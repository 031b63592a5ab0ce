"""One-row dense matmul kernel against the fp32 product, and `dense_linear`'s choice of path.

On CPU the kernel runs in Triton's interpreter on small shapes (fp16, fp32 and bf16: the interpreter's
bf16 is wrong only in dots, and this kernel has none); the `gpu` tests use the 8B model's shapes in
bf16. Outputs are poisoned before each call.
"""
import pytest
import torch
import torch.nn.functional as F

from compute_service.engine.linear import GEMV_MIN_ELEMENTS, Linear, dense_linear
from kernels.dense_gemv import DenseGemvConfig, dense_gemv, pick_gemv_config

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float16: 2e-3, torch.bfloat16: 1e-2, torch.float32: 1e-5}


def check(n: int, k: int, dtype: torch.dtype, has_bias: bool, config: DenseGemvConfig | None = None) -> None:
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    w = (torch.randn(n, k, generator=gen) * 0.05).to(dtype).to(DEVICE)
    x = torch.randn(1, k, generator=gen).to(dtype).to(DEVICE)
    bias = torch.randn(n, generator=gen).to(dtype).to(DEVICE) if has_bias else None
    want = x.float() @ w.float().t() + (bias.float() if has_bias else 0.0)
    out = torch.full((1, n), float("nan"), dtype=dtype, device=DEVICE)
    dense_gemv(x, w, bias, out, config)
    assert not torch.isnan(out).any(), "output left unwritten"
    err = ((out.float() - want).norm() / want.norm()).item()
    assert err < TOL[dtype], f"rel err {err} (N={n} K={k} {dtype} {config})"


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("has_bias", [False, True])
def test_matches_fp32_product(dtype: torch.dtype, has_bias: bool) -> None:
    # N = 40: a partial feature tile; K = 200: a partial K step (not a multiple of 64 or 128).
    for n, k in ((40, 200), (16, 128)):
        check(n, k, dtype, has_bias, DenseGemvConfig(16, 64, 2))
    check(33, 384, dtype, has_bias, DenseGemvConfig(32, 128, 4))


def test_weight_rows_may_be_strided() -> None:
    """A weight viewed out of a wider one (row stride > K) reads only its own columns."""
    gen = torch.Generator().manual_seed(3)
    wide = torch.randn(24, 96, generator=gen).to(DEVICE)
    w = wide[:, 16:80]
    x = torch.randn(64, generator=gen).to(DEVICE)
    out = torch.full((24,), float("nan"), device=DEVICE)
    dense_gemv(x, w, None, out, DenseGemvConfig(16, 32, 2))
    torch.testing.assert_close(out, w @ x, rtol=1e-5, atol=1e-5)


def test_rejects_bad_arguments() -> None:
    w = torch.zeros(8, 32, device=DEVICE)
    with pytest.raises(ValueError, match="one row"):
        dense_gemv(torch.zeros(2, 32, device=DEVICE), w, None, torch.zeros(8, device=DEVICE))
    with pytest.raises(ValueError, match="w must be"):
        dense_gemv(torch.zeros(32, device=DEVICE), w.t(), None, torch.zeros(32, device=DEVICE))
    with pytest.raises(ValueError, match="out must be"):
        dense_gemv(torch.zeros(32, device=DEVICE), w, None, torch.zeros(7, device=DEVICE))


def test_config_choice() -> None:
    assert pick_gemv_config(28672, 4096) == DenseGemvConfig(16, 256, 4)
    assert pick_gemv_config(6144, 4096) == DenseGemvConfig(16, 512, 8)
    assert pick_gemv_config(4096, 14336) == DenseGemvConfig(16, 512, 8)


def test_dense_linear_on_cpu_is_the_library_call() -> None:
    """CPU tensors (and anything the kernel does not take) go through F.linear unchanged."""
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(16, 8, generator=gen)
    b = torch.randn(16, generator=gen)
    for x in (torch.randn(1, 8, generator=gen), torch.randn(3, 8, generator=gen)):
        assert torch.equal(dense_linear(x, w, b), F.linear(x, w, b))
        assert torch.equal(Linear(w, b)(x), F.linear(x, w, b))


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (49152, 576)])
def test_gpu_8b_shapes(n: int, k: int) -> None:
    check(n, k, torch.bfloat16, False)
    check(n, k, torch.bfloat16, True)


@pytest.mark.gpu
def test_gpu_dense_linear_takes_the_kernel_for_one_row() -> None:
    """One bf16 row on a large weight: the kernel's result (not the library's); several rows: F.linear."""
    n, k = GEMV_MIN_ELEMENTS // 1024, 1024
    w = (torch.randn(n, k, device="cuda") * 0.05).bfloat16()
    x = torch.randn(1, k, device="cuda").bfloat16()
    out = torch.empty(1, n, dtype=torch.bfloat16, device="cuda")
    dense_gemv(x, w, None, out)
    assert torch.equal(dense_linear(x, w), out)
    x3 = torch.randn(3, k, device="cuda").bfloat16()
    assert torch.equal(dense_linear(x3, w), F.linear(x3, w))


@pytest.mark.gpu
def test_gpu_under_graph_capture() -> None:
    w = (torch.randn(8192, 4096, device="cuda") * 0.05).bfloat16()
    x = torch.randn(1, 4096, device="cuda").bfloat16()
    out = torch.empty(1, 8192, dtype=torch.bfloat16, device="cuda")
    dense_gemv(x, w, None, out)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        dense_gemv(x, w, None, out)
    x.copy_(torch.randn(1, 4096, device="cuda").bfloat16())
    out.fill_(float("nan"))
    g.replay()
    want = x.float() @ w.float().t()
    assert ((out.float() - want).norm() / want.norm()).item() < 1e-2


@pytest.mark.parametrize("has_bias", [False, True])
def test_addend_is_added_before_rounding_and_left_zero(has_bias: bool) -> None:
    """out = round(w @ x + bias + addend); the float32 addend (a LoRA delta) is zero afterwards."""
    gen = torch.Generator().manual_seed(11)
    dtype = torch.float16
    for n, k, cfg in ((40, 200, DenseGemvConfig(16, 64, 2)), (33, 384, DenseGemvConfig(32, 128, 4))):
        w = (torch.randn(n, k, generator=gen) * 0.05).to(dtype).to(DEVICE)
        x = torch.randn(1, k, generator=gen).to(dtype).to(DEVICE)
        bias = torch.randn(n, generator=gen).to(dtype).to(DEVICE) if has_bias else None
        add = torch.randn(1, n, generator=gen).to(DEVICE)
        want = x.float() @ w.float().t() + (bias.float() if has_bias else 0.0) + add
        addend = add.clone()
        out = torch.full((1, n), float("nan"), dtype=dtype, device=DEVICE)
        dense_gemv(x, w, bias, out, cfg, addend=addend)
        err = ((out.float() - want).norm() / want.norm()).item()
        assert err < TOL[dtype], err
        assert not addend.any(), "the addend must be left all zeros"
    with pytest.raises(ValueError, match="addend"):
        dense_gemv(x, w, bias, out, cfg, addend=add.half())
