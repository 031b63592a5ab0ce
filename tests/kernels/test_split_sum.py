"""Split-K partials summed by the next kernel (`kernels.split_sum`): the quantized matmul with `defer_split` stores
partials whose in-order sum is the output the in-launch sum writes, and the norm, RoPE + cache and SwiGLU kernels
given those partials write what they write given that output.

CPU: Triton's interpreter, small shapes; `gpu`: the compiled kernels, the 8B's one-row and asynchronous-dot shapes.
"""
from __future__ import annotations

import pytest
import torch

from kernels.quant_matmul import QuantMatmulConfig, launch_split, pick_config, quant_matmul
from kernels.quant_pack import pack_quantized
from kernels.rms_norm import add_rms_norm
from kernels.rope_cache import rope_and_cache
from kernels.silu_mul import silu_mul
from kernels.split_sum import SplitSum, summed_input
from test_quant_matmul import DEVICE, random_weight

GPU_ONLY = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _both_ways(x, w, bias, cfg, addend=None):
    """(the in-launch output, the deferred partials as a SplitSum) of one call each, same inputs."""
    T, N = x.shape[0], w.out_features
    split = launch_split(cfg, w)
    assert split > 1
    out = torch.full((T, N), float("nan"), dtype=x.dtype, device=x.device)
    locks = torch.zeros(4 * -(-N // 16) * max(1, -(-T // 16)), dtype=torch.int32, device=x.device)
    part = torch.full((split * T * N,), float("nan"), device=x.device)
    first = None if addend is None else addend.clone()
    quant_matmul(x, w, bias, out, cfg, part, locks, addend=first)
    parts = torch.full((split, T, N), float("nan"), device=x.device)
    unwritten = torch.full_like(out, float("nan"))
    second = None if addend is None else addend.clone()
    quant_matmul(x, w, bias, unwritten, cfg, parts, None, addend=second, defer_split=True)
    assert torch.isnan(unwritten).all(), "with defer_split the output is not written"
    assert not torch.isnan(parts).any(), "every split's partial is stored"
    if addend is not None:
        assert not first.any() and not second.any(), "the addend is left all zeros either way"
    return out, SplitSum(parts, x.dtype)


@pytest.mark.parametrize("T,cfg", [(1, QuantMatmulConfig(16, 1, 3)), (1, QuantMatmulConfig(32, 1, 2)),
                                   (5, QuantMatmulConfig(16, 16, 2)), (19, QuantMatmulConfig(16, 16, 3))])
@pytest.mark.parametrize("bits,group", [(4, 128), (4, 32), (8, 64)])
def test_deferred_partials_sum_to_the_output(T: int, cfg: QuantMatmulConfig, bits: int, group: int) -> None:
    gen = torch.Generator().manual_seed(7 * T + bits + group)
    N, K = 40, 768
    q, s, o = random_weight(N, K, bits, group, gen)
    w = pack_quantized(q, s, o, bits, group)
    x = torch.randn(T, K, generator=gen).half().to(DEVICE)
    out, summed = _both_ways(x, w, None, cfg)
    assert torch.equal(summed.materialize(), out), "no bias: the same sum in the same order"
    bias = torch.randn(N, generator=gen).half().to(DEVICE)
    out, summed = _both_ways(x, w, bias, cfg)       # the bias added to the first partial, not last: rounding apart
    assert torch.allclose(summed.materialize().float(), out.float(), rtol=2e-3, atol=2e-3)


def test_deferred_one_row_with_an_addend() -> None:
    gen = torch.Generator().manual_seed(11)
    N, K = 40, 1024
    q, s, o = random_weight(N, K, 4, 128, gen)
    w = pack_quantized(q, s, o, 4, 128)
    x = torch.randn(1, K, generator=gen).half().to(DEVICE)
    add = torch.randn(1, N, generator=gen).to(DEVICE)
    out, summed = _both_ways(x, w, None, QuantMatmulConfig(16, 1, 4), addend=add)
    assert torch.allclose(summed.materialize().float(), out.float(), rtol=2e-3, atol=2e-3)
    plain, _ = _both_ways(x, w, None, QuantMatmulConfig(16, 1, 4))
    assert not torch.allclose(out.float(), plain.float(), rtol=1e-3, atol=1e-3), "the addend was added"


def _random_split(T: int, N: int, split: int, gen: torch.Generator, dtype=torch.float16) -> SplitSum:
    return SplitSum((torch.randn(split, T, N, generator=gen) / split ** 0.5).to(DEVICE), dtype)


@pytest.mark.parametrize("T", [1, 3])
def test_norm_and_swiglu_sum_the_partials(T: int) -> None:
    gen = torch.Generator().manual_seed(T)
    H, inter = 64, 96
    x = _random_split(T, H, 4, gen)
    h = torch.randn(T, H, generator=gen).half().to(DEVICE)
    w = (torch.rand(H, generator=gen) + 0.5).half().to(DEVICE)
    extra = torch.randn(T, H, generator=gen).half().to(DEVICE)
    for e in (None, extra):
        outs = []
        for src in (x, x.materialize()):
            res, out = h.clone(), torch.empty(T, H, dtype=torch.float16, device=DEVICE)
            sums = torch.empty(T, H // 32, device=DEVICE)
            add_rms_norm(src, res, w, 1e-5, out, res, sums, e)
            outs.append((res, out, sums))
        for a, b in zip(*outs):
            assert torch.equal(a, b)
    gu = _random_split(T, 2 * inter, 2, gen)
    extra = torch.randn(T, 2 * inter, generator=gen).half().to(DEVICE)
    for e in (None, extra):
        outs = []
        for src in (gu, gu.materialize()):
            out, sums = torch.empty(T, inter, dtype=torch.float16, device=DEVICE), torch.empty(T, 3, device=DEVICE)
            silu_mul(src, out, sums, e)
            outs.append((out, sums))
        for a, b in zip(*outs):
            assert torch.equal(a, b)


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (6, 1), (2, 2)])
def test_rope_and_cache_sums_the_partials(heads: int, kv_heads: int) -> None:
    """RoPE + cache write from partials (one program a KV head and its query heads) against the same from the
    summed tensor (one program a token)."""
    gen = torch.Generator().manual_seed(heads * 10 + kv_heads)
    T, D, blocks, block = 3, 16, 4, 4
    qkv = _random_split(T, (heads + 2 * kv_heads) * D, 3, gen)
    pos = torch.tensor([0, 5, 9], device=DEVICE)
    slots = torch.tensor([2, 7, 13], device=DEVICE)
    ang = torch.rand(16, D, generator=gen).to(DEVICE)
    cos, sin = ang.cos().contiguous(), ang.sin().contiguous()
    extra = torch.randn(T, qkv.shape[1], generator=gen).half().to(DEVICE)
    for e in (None, extra):
        outs = []
        for src in (qkv, qkv.materialize()):
            q = torch.empty(T, heads, D, dtype=torch.float16, device=DEVICE)
            kc = torch.zeros(blocks, block, kv_heads, D, dtype=torch.float16, device=DEVICE)
            vc = torch.zeros_like(kc)
            rope_and_cache(src, pos, slots, cos, sin, q, kc, vc, e)
            outs.append((q, kc, vc))
        for a, b in zip(*outs):
            assert torch.equal(a, b)


def test_split_sum_checks_and_helpers() -> None:
    with pytest.raises(ValueError, match="S >= 2"):
        SplitSum(torch.zeros(1, 2, 3), torch.float16)
    with pytest.raises(ValueError, match="float32"):
        SplitSum(torch.zeros(2, 2, 3, dtype=torch.float16), torch.float16)
    parts = torch.tensor([[[1.0, 2.0]], [[0.5, -4.0]], [[0.25, 1.0]]])
    s = SplitSum(parts, torch.bfloat16)
    assert s.shape == (1, 2) and s.stride() == (2, 1) and s.stride(0) == 2 and s.dim() == 2
    assert torch.equal(s.materialize(), torch.tensor([[1.75, -1.0]], dtype=torch.bfloat16))
    assert summed_input(s) == (parts, 3, 2)
    t = torch.zeros(2, 2)
    assert summed_input(t) == (t, 0, 0)


@GPU_ONLY
@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 8, 32])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 14336)])
def test_gpu_deferred_partials_on_the_engine_configs(T: int, n: int, k: int) -> None:
    """pick_config's own choice for the 8B's q/k/v and down (one-row kernels at 1 row, the asynchronous-dot kernel
    at 8 and 32 where it runs), bf16 without bias: the deferred sum is the in-launch output, bit for bit."""
    gen = torch.Generator().manual_seed(T + n)
    q, s, o = random_weight(n, k, 4, 128, gen)
    w = pack_quantized(q, s, o, 4, 128)
    x = torch.randn(T, k, generator=gen).to(DEVICE, torch.bfloat16)
    from kernels.quant_wgmma import async_dots_enabled

    cfg = pick_config(T, n, k, 4, torch.cuda.get_device_properties(0).multi_processor_count, 128, torch.bfloat16,
                      async_dots=async_dots_enabled(x.device))
    if launch_split(cfg, w) == 1:
        pytest.skip(f"{cfg} does not split K here")
    out, summed = _both_ways(x, w, None, cfg)
    assert torch.equal(summed.materialize(), out)
