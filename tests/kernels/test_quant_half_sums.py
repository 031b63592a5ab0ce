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
