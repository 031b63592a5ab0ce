"""The norm and the SwiGLU write x in an act-order projection's channel order (`kernels.perm`): out[:, j] is the
result's channel perm[j], bit for bit what the kernel writes without a perm, with out's slice sums, and the
result in the model's order too where asked (a LoRA launch reads it). Partials (split-K), an extra, rows that
do not fill the block, and rows spread over several programs. Triton's interpreter on the CPU, the GPU with
CUDA."""
from __future__ import annotations

import pytest
import torch

from kernels.rms_norm import add_rms_norm
from kernels.silu_mul import silu_mul
from kernels.split_sum import SplitSum

CASES = [pytest.param("cpu", torch.float16, marks=pytest.mark.skipif(torch.cuda.is_available(),
                                                                     reason="interpreter runs only")),
         pytest.param("cuda", torch.float16, marks=pytest.mark.gpu),
         pytest.param("cuda", torch.bfloat16, marks=pytest.mark.gpu)]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _perm(n: int, gen: torch.Generator, device: str) -> torch.Tensor:
    return torch.randperm(n, generator=gen).to(device, torch.int32)


def _sums_close(sums: torch.Tensor, out: torch.Tensor, width: int) -> None:
    want = out.float().reshape(out.shape[0], -1, width).sum(-1)
    assert torch.allclose(sums, want, rtol=1e-5, atol=1e-4)


def _source(T: int, n: int, split: int, gen: torch.Generator, dtype: torch.dtype,
            device: str) -> torch.Tensor | SplitSum:
    if split:
        return SplitSum((torch.randn(split, T, n, generator=gen) / split ** 0.5).to(device), dtype)
    return torch.randn(T, n, generator=gen).to(device, dtype)


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("T,H,split,width", [(1, 96, 0, 32), (3, 64, 4, 32), (2, 200, 0, 0), (1, 256, 3, 128)])
def test_norm_writes_x_in_the_projection_order(device, dtype, T: int, H: int, split: int, width: int) -> None:
    gen = torch.Generator().manual_seed(T * H + split)
    x = _source(T, H, split, gen, dtype, device)
    h = torch.randn(T, H, generator=gen).to(device, dtype)
    w = (torch.rand(H, generator=gen) + 0.5).to(device, dtype)
    extra = torch.randn(T, H, generator=gen).to(device, dtype)
    perm = _perm(H, gen, device)
    for e in (None, extra):
        res_want, want = h.clone(), torch.empty(T, H, dtype=dtype, device=device)
        add_rms_norm(x, res_want, w, 1e-5, want, res_want, extra=e)
        for with_model in (False, True):
            res, out = h.clone(), torch.full((T, H), float("nan"), dtype=dtype, device=device)
            model = torch.full_like(out, float("nan")) if with_model else None
            sums = torch.full((T, H // width), float("nan"), device=device) if width else None
            add_rms_norm(x, res, w, 1e-5, out, res, sums, e, perm=perm, model_out=model)
            assert torch.equal(res, res_want)
            assert torch.equal(out, want[:, perm.long()])
            if model is not None:
                assert torch.equal(model, want)
            if sums is not None:
                _sums_close(sums, out, width)
    first = h.clone()                           # no residual: x alone normalised, in perm's order
    out = torch.empty_like(first)
    add_rms_norm(first, None, w, 1e-5, out, perm=perm)
    want = torch.empty_like(first)
    add_rms_norm(first, None, w, 1e-5, want)
    assert torch.equal(out, want[:, perm.long()])


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("T,inter,split,width", [(1, 96, 0, 32), (2, 600, 2, 0), (1, 1024, 4, 128),
                                                 (3, 2304, 0, 128)])
def test_swiglu_writes_x_in_the_projection_order(device, dtype, T: int, inter: int, split: int, width: int) -> None:
    gen = torch.Generator().manual_seed(T * inter + split)
    gu = _source(T, 2 * inter, split, gen, dtype, device)
    extra = torch.randn(T, 2 * inter, generator=gen).to(device, dtype)
    perm = _perm(inter, gen, device)
    inverse = torch.argsort(perm).to(torch.int32)
    for e, inv in ((None, None), (extra, None), (None, inverse), (extra, inverse)):   # gathered or scattered
        want = torch.empty(T, inter, dtype=dtype, device=device)
        silu_mul(gu, want, extra=e)
        for with_model in (False, True):
            out = torch.full((T, inter), float("nan"), dtype=dtype, device=device)
            model = torch.full_like(out, float("nan")) if with_model else None
            sums = torch.full((T, inter // width), float("nan"), device=device) if width else None
            silu_mul(gu, out, sums, e, perm=perm, model_out=model, inverse=inv)
            assert torch.equal(out, want[:, perm.long()])
            if model is not None:
                assert torch.equal(model, want)
            if sums is not None:
                _sums_close(sums, out, width)


def test_perm_checks() -> None:
    x = torch.randn(2, 64, device=DEVICE, dtype=torch.float16)
    w = torch.ones(64, device=DEVICE, dtype=torch.float16)
    out = torch.empty_like(x)
    perm = torch.randperm(64).to(DEVICE)
    with pytest.raises(ValueError, match="perm must be contiguous int32"):
        add_rms_norm(x, None, w, 1e-5, out, perm=perm)                       # int64
    with pytest.raises(ValueError, match="perm must be contiguous int32"):
        add_rms_norm(x, None, w, 1e-5, out, perm=perm[:32].int())
    with pytest.raises(ValueError, match="model_out is written only with a perm"):
        add_rms_norm(x, None, w, 1e-5, out, model_out=torch.empty_like(x))
    with pytest.raises(ValueError, match="give perm too"):
        silu_mul(torch.randn(2, 128, device=DEVICE, dtype=torch.float16), out, inverse=perm.int())
    with pytest.raises(ValueError, match="model_out must be contiguous"):
        silu_mul(torch.randn(2, 128, device=DEVICE, dtype=torch.float16), out, perm=perm.int(),
                 model_out=torch.empty(2, 64, device=DEVICE))


@pytest.mark.parametrize("device", [CASES[0].values[0], pytest.param("cuda", marks=pytest.mark.gpu)])
def test_gather_columns(device) -> None:
    """x[:, perm] in one launch (o's x, from attention, under an act-order o): rows of a wider tensor too."""
    from kernels.perm import gather_columns

    if device == "cpu" and torch.cuda.is_available():
        pytest.skip("interpreter runs only")
    gen = torch.Generator().manual_seed(2)
    wide = torch.randn(3, 2600, generator=gen).to(device, torch.float16)
    perm = _perm(2500, gen, device)
    for x in (wide[:, :2500], wide[:1, 100:2600].contiguous(), wide[:0, :2500]):
        assert torch.equal(gather_columns(x, perm), x[:, perm.long()])
    with pytest.raises(ValueError, match="contiguous rows"):
        gather_columns(wide.t(), perm)
