"""Sums of x over 128-wide halves (the pair-codes path's offsets term) against torch, and its input checks."""
import pytest
import torch

from kernels.quant_half_sums import half_sums_into

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("T,K", [(1, 128), (3, 640), (5, 4608)])      # 1, 5 and 36 halves (a partial program)
def test_half_sums_match_torch(T: int, K: int) -> None:
    gen = torch.Generator().manual_seed(T * K)
    x = torch.randn(T, K + 64, generator=gen).half().to(DEVICE)[:, :K]     # rows strided past K
    out = torch.full((T, K // 128), float("nan"), device=DEVICE)
    half_sums_into(x, out)
    want = x.float().reshape(T, K // 128, 128).sum(-1)
    assert torch.allclose(out, want, rtol=1e-5, atol=1e-4)


def test_half_sums_check_inputs() -> None:
    x = torch.zeros(2, 200, dtype=torch.float16, device=DEVICE)
    with pytest.raises(ValueError, match="K % 128"):
        half_sums_into(x, torch.zeros(2, 1, device=DEVICE))
    with pytest.raises(ValueError, match="float32"):
        half_sums_into(x[:, :128], torch.zeros(2, 1, dtype=torch.float16, device=DEVICE))
