"""QuantLinear: the CPU path is dequantize + F.linear; the packed kernel path (interpreter on CPU, Triton on
the GPU) is close to the fp32 reference; nbytes counts packed bytes; the canonical form survives packing."""
import pytest
import torch
import torch.nn.functional as F

from compute_service.engine.quant_linear import QuantLinear
from compute_service.engine.quantized import QuantizedWeight, quantize_rtn


def fresh(seed_extra: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed((torch.seed() + seed_extra) % 2**31)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    assert not torch.isnan(got).any()
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


@pytest.mark.parametrize("bits,group", [(4, 32), (4, 128), (8, 64)])
@pytest.mark.parametrize("has_bias", [False, True])
def test_cpu_path_is_dequantize_then_linear(bits: int, group: int, has_bias: bool) -> None:
    g = fresh()
    qw = quantize_rtn(torch.randn(48, 256, generator=g) * 0.05, bits, group)
    bias = torch.randn(48, generator=g) if has_bias else None
    lin = QuantLinear(qw, bias, torch.device("cpu"))
    x = torch.randn(5, 256, generator=g)
    assert torch.equal(lin(x), F.linear(x, qw.dequantize(torch.float32), bias))
    assert (lin.in_features, lin.out_features, lin.bits, lin.group_size) == (256, 48, bits, group)


@pytest.mark.parametrize("bits,group", [(4, 32), (4, 128), (8, 64)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_kernel_path_matches_reference(bits: int, group: int, dtype: torch.dtype) -> None:
    """Packed path forced on CPU (Triton's interpreter): decode rows, split-K, and the dense prefill path."""
    g = fresh(1)
    qw = quantize_rtn(torch.randn(40, 512, generator=g) * 0.05, bits, group)
    bias = torch.randn(40, generator=g).to(dtype)
    lin = QuantLinear(qw, bias, torch.device("cpu"), use_kernel=True, dense_min_tokens=24)
    # float32: the one-row kernel's biased sums (BIAS + q) x round to ~4e-6 of the result (8.3e-6 the worst of 150
    # draws against a float64 reference); TF32 products would give 1e-4 or more.
    tol = 4e-5 if dtype == torch.float32 else 2e-3
    for t in (1, 3, 30):                                          # 30 >= dense_min_tokens: dequantize + GEMM
        x = torch.randn(t, 512, generator=g).to(dtype)
        want = F.linear(x.double(), qw.dequantize(torch.float32).double(), bias.double())
        got = lin(x)
        assert got.dtype == dtype and got.shape == (t, 40)
        assert rel_err(got, want) < tol, (t, rel_err(got, want))
    assert int(lin.locks.abs().sum()) == 0


def test_kernel_path_switches_to_dense_at_the_kernels_rule() -> None:
    """Without dense_min_tokens, a call dequantizes + runs a GEMM from `dense_min_rows`: 384 rows for a large
    4-bit weight in groups of 128 (the pair-codes tiles are faster up to there), 129 in groups of 32, 65
    otherwise."""
    g = fresh(3)
    big = QuantLinear(quantize_rtn(torch.randn(4096, 1024, generator=g), 4, 128), None, torch.device("cpu"),
                      use_kernel=True)
    big32 = QuantLinear(quantize_rtn(torch.randn(4096, 1024, generator=g), 4, 32), None, torch.device("cpu"),
                        use_kernel=True)
    small = QuantLinear(quantize_rtn(torch.randn(64, 512, generator=g), 4, 32), None, torch.device("cpu"),
                        use_kernel=True)
    assert (big.dense_min_tokens, big32.dense_min_tokens, small.dense_min_tokens) == (384, 129, 65)


def test_kernel_path_keeps_the_canonical_form() -> None:
    g = fresh(2)
    qw = quantize_rtn(torch.randn(24, 320, generator=g), 4, 32)       # 320: padded to the 256-wide block
    lin = QuantLinear(qw, None, torch.device("cpu"), use_kernel=True)
    back = lin.qweight
    assert isinstance(back, QuantizedWeight)
    assert torch.equal(back.q, qw.q) and torch.equal(back.scales, qw.scales) and torch.equal(back.offsets, qw.offsets)
    assert torch.equal(lin.dequantize(), qw.dequantize())
    assert not hasattr(lin, "_qweight") or lin._qweight is None      # only the packed form is held


@pytest.mark.parametrize("use_kernel", [False, True])
def test_nbytes_counts_packed_bytes(use_kernel: bool) -> None:
    n, k, group = 64, 1024, 128
    qw = quantize_rtn(torch.randn(n, k), 4, group)
    lin = QuantLinear(qw, torch.randn(n), torch.device("cpu"), use_kernel=use_kernel)
    want = n * k // 2 + 2 * (n * k // group) * 2 + n * 4       # nibbles, fp16 scales + offsets, fp32 bias
    assert lin.nbytes == want
    assert lin.nbytes < torch.empty(n, k, dtype=torch.bfloat16).nbytes / 3


def test_group_sizes_the_packed_layout_cannot_hold() -> None:
    qw = quantize_rtn(torch.randn(8, 192), 4, 96)
    with pytest.raises(ValueError, match="group size"):
        QuantLinear(qw, None, torch.device("cpu"), use_kernel=True)
    lin = QuantLinear(qw, None, torch.device("cpu"))
    assert not lin.use_kernel and torch.equal(lin.dequantize(), qw.dequantize())


@pytest.mark.gpu
def test_gpu_unpackable_group_size_dequantizes_per_call() -> None:
    dev = torch.device("cuda")
    qw = quantize_rtn(torch.randn(32, 192, device=dev), 4, 96)
    lin = QuantLinear(qw, None, dev)
    assert not lin.use_kernel
    x = torch.randn(3, 192, device=dev)
    assert torch.equal(lin(x), F.linear(x, qw.dequantize(torch.float32)))


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 14336), (28672, 1024)])
@pytest.mark.parametrize("bits", [4, 8])
def test_gpu_close_to_fp32_reference(n: int, k: int, bits: int) -> None:
    """Every path a row count takes (28672 features at 100 / 250 / 300 rows: the asynchronous-dot kernel's wide
    tiles on sm_90+; 200: the tiles; 512: dequantize + GEMM)."""
    dev = torch.device("cuda")
    g = fresh(3)
    qw = quantize_rtn((torch.randn(n, k, generator=g) * 0.02).to(dev), bits, 128)
    lin = QuantLinear(qw, None, dev)
    w = qw.dequantize(torch.float32)
    for t in (1, 8, 64, 100, 200, 250, 300, 512):
        x = torch.randn(t, k, generator=g).to(dev, torch.bfloat16)
        assert rel_err(lin(x), F.linear(x.float(), w)) < 1e-2, t
    x = torch.randn(3, k, generator=g).to(dev)
    assert rel_err(lin(x), F.linear(x, w)) < 1e-5                     # float32 model: IEEE products
    assert lin.nbytes == n * k * bits // 8 + 2 * n * (k // 128) * 2


@pytest.mark.gpu
def test_gpu_act_order_weight_reads_x_in_its_order() -> None:
    """An act-order weight (codes stored by group, `perm`) on the GPU kernels: the one-row, tile and
    dequantize + GEMM paths all equal x @ W^T with W in the model's channel order."""
    dev = torch.device("cuda")
    g = fresh(5)
    n, k = 512, 1024
    qw = quantize_rtn((torch.randn(n, k, generator=g) * 0.02).to(dev), 4, 128)
    perm = torch.randperm(k, generator=g).to(dev)
    qw = QuantizedWeight(qw.q, qw.scales, qw.offsets, 4, 128, perm)
    lin = QuantLinear(qw, None, dev)
    assert lin.use_kernel and lin.act_order and not lin.takes_addend(torch.zeros(1, k, device=dev,
                                                                                dtype=torch.bfloat16))
    w = qw.dequantize(torch.float32)
    assert torch.equal(lin.dequantize(), w)
    for t in (1, 8, 64, lin.dense_min_tokens):
        x = torch.randn(t, k, generator=g).to(dev, torch.bfloat16)
        assert rel_err(lin(x), F.linear(x.float(), w)) < 1e-2, t
