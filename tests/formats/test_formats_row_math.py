"""The converter's row arithmetic equals one torch.mul, bit for bit, on any finite input."""
from __future__ import annotations

import pytest
import torch

from loraplex.formats import row_math

BITS = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


def random_bits(dtype: torch.dtype, n: int, gen: torch.Generator) -> torch.Tensor:
    """Every bit pattern equally likely (subnormals, huge values, ties), NaN patterns replaced by 1.0."""
    info = torch.iinfo(BITS[dtype])
    raw = torch.randint(info.min, info.max, (n,), generator=gen, dtype=torch.int64).to(BITS[dtype]).view(dtype)
    return torch.where(torch.isnan(raw), torch.ones((), dtype=dtype), raw)


@pytest.fixture(params=["slices", "one_thread"])
def torch_threads(request):
    """scale_into's two ways: slices below the grain size (several torch threads), one call (one thread)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1 if request.param == "one_thread" else max(2, before))
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n", [7, 4099, 3 * row_math.SLICE_ELEMS + 5])
def test_scale_into_matches_torch_mul(dtype, n, torch_threads):
    gen = torch.Generator().manual_seed(n)
    for scale in (1.0, 2.0, 0.1, 1 / 3, 3.7e4, 1e-30, float(torch.rand((), generator=gen)) * 64):
        src = random_bits(dtype, n, gen)
        dst = torch.empty(n, dtype=dtype)
        row_math.scale_into(src, scale, dst)
        want = src * scale
        same = (dst.view(BITS[dtype]) == want.view(BITS[dtype])) | (torch.isnan(want) & torch.isnan(dst))
        assert bool(same.all()), (scale, src[~same][:4], dst[~same][:4], want[~same][:4])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_copy_and_finite_check(dtype):
    gen = torch.Generator().manual_seed(0)
    src = torch.randn(33, 5, generator=gen).to(dtype)
    dst = torch.full((33, 5), 7.0, dtype=dtype)
    row_math.copy_into(src, dst)
    assert torch.equal(dst, src) and row_math.all_finite(dst)
    for bad in (float("nan"), float("inf"), float("-inf")):
        for where in ((0, 0), (20, 3), (32, 4)):
            probe = src.clone()
            probe[where] = bad
            assert not row_math.all_finite(probe), (bad, where)
            assert not row_math.all_finite(probe[where[0]])
    assert row_math.all_finite(torch.full((4,), torch.finfo(dtype).max, dtype=dtype))
