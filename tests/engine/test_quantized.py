"""The canonical quantized weight: round-to-nearest error bounds, zero points, fusion, validation."""
import pytest
import torch

from compute_service.engine.quantized import QuantizedWeight, integer_zeros, quantize_rtn


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("group_size", [32, 64])
def test_rtn_error_within_half_a_step(bits: int, symmetric: bool, group_size: int) -> None:
    g = torch.Generator().manual_seed(bits * 100 + group_size + symmetric)
    w = torch.randn(24, 128, generator=g) * 0.05
    qw = quantize_rtn(w, bits, group_size, symmetric=symmetric)
    assert qw.q.dtype == torch.uint8 and int(qw.q.max()) <= 2 ** bits - 1
    step = qw.scales.float().repeat_interleave(group_size, dim=1)                 # [N, K]
    err = (qw.dequantize() - w).abs()
    # half a step of rounding, plus the float16 rounding of the offset (-z * s)
    assert bool((err <= 0.5 * step + 1e-3 * w.abs().amax()).all())
    z = integer_zeros(qw)
    assert torch.equal((-(z.float()) * qw.scales.float()).half(), qw.offsets)
    if symmetric:
        assert bool((z == 2 ** (bits - 1)).all())


def test_dequantize_is_codes_times_scales_plus_offsets() -> None:
    q = torch.randint(0, 16, (3, 8), dtype=torch.uint8)
    s = torch.rand(3, 2).half() + 0.1
    o = -torch.rand(3, 2).half()
    w = QuantizedWeight(q, s, o, 4, 4).dequantize()
    want = q.float().view(3, 2, 4) * s.float()[..., None] + o.float()[..., None]
    assert torch.equal(w, want.view(3, 8))


def test_cat_and_rows_round_trip() -> None:
    a, b = quantize_rtn(torch.randn(8, 64), 4, 32), quantize_rtn(torch.randn(4, 64), 4, 32)
    fused = QuantizedWeight.cat([a, b])
    assert fused.shape == (12, 64)
    assert torch.equal(fused.rows(8, 12).dequantize(), b.dequantize())
    with pytest.raises(ValueError, match="differ"):
        QuantizedWeight.cat([a, quantize_rtn(torch.randn(4, 64), 4, 64)])


def test_bad_shapes_and_types_are_refused() -> None:
    q = torch.zeros(2, 8, dtype=torch.uint8)
    s = torch.ones(2, 2, dtype=torch.float16)
    with pytest.raises(ValueError, match="group size"):
        QuantizedWeight(q, s, s, 4, 3)
    with pytest.raises(ValueError, match="bits"):
        QuantizedWeight(q, s, s, 3, 4)
    with pytest.raises(ValueError, match="scales"):
        QuantizedWeight(q, s.float(), s, 4, 4)
    with pytest.raises(ValueError, match="uint8"):
        QuantizedWeight(q.to(torch.int32), s, s, 4, 4)


def test_integer_zeros_refuses_float_offsets() -> None:
    q = torch.zeros(1, 4, dtype=torch.uint8)
    qw = QuantizedWeight(q, torch.tensor([[0.5]]).half(), torch.tensor([[-0.3]]).half(), 4, 4)
    with pytest.raises(ValueError, match="integer zero"):
        integer_zeros(qw)
