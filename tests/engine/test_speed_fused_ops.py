"""The fused Triton ops the model uses on CUDA equal the torch ops they replace.

On CPU they run in Triton's interpreter (fp32, fp16); on a GPU also in bf16,
where they must match the rounding of the torch version to the last bit on
almost every element.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from compute_service.engine.model import rms_norm
from compute_service.engine.rope import RotaryEmbedding
from compute_service.engine.spec import RopeScaling
from kernels.rms_norm import add_rms_norm
from kernels.rope_cache import rope_and_cache
from kernels.silu_mul import silu_mul

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(torch.seed() % 2**31)


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    err = (got.float() - want.float()).abs().max() / want.float().abs().max()
    assert torch.isfinite(got).all() and err < TOL[dtype], err


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,H", [(3, 64), (5, 200)])
def test_add_rms_norm(dtype, T, H):
    g = _gen()
    x, r = (torch.randn(T, H, generator=g).to(DEVICE, dtype) for _ in range(2))
    w = (1 + 0.2 * torch.randn(H, generator=g)).to(DEVICE, dtype)
    out = torch.full_like(x, float("nan"))
    add_rms_norm(x, None, w, 1e-5, out)
    _close(out, rms_norm(x, w, 1e-5), dtype)
    res = r.clone()
    add_rms_norm(x, res, w, 1e-5, out, res)              # residual updated in place
    _close(res, r + x, dtype)
    _close(out, rms_norm(r + x, w, 1e-5), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul(dtype):
    g = _gen()
    gu = torch.randn(4, 2 * 80, generator=g).to(DEVICE, dtype)
    out = torch.full((4, 80), float("nan"), dtype=dtype, device=DEVICE)
    silu_mul(gu, out)
    _close(out, F.silu(gu[:, :80]) * gu[:, 80:], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H,KVH,D,extra", [(4, 2, 16, False), (6, 2, 64, False), (8, 8, 32, False),
                                           (4, 2, 16, True)])
def test_rope_and_cache(dtype, H, KVH, D, extra):
    """With `extra` (the 2-16-token LoRA delta from the side stream, `LlamaModel._project`) the kernel rotates
    and caches qkv + extra, as if `qkv.add_(extra)` had run first; here qkv is a view with a row stride of its
    own."""
    g = _gen()
    T, blocks, bs = 5, 6, 4
    scaling = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=16)
    rope = RotaryEmbedding(D, 64, 500000.0, scaling, torch.device(DEVICE))
    width = (H + 2 * KVH) * D
    qkv = torch.randn(T, width + 8 * extra, generator=g).to(DEVICE, dtype)[:, :width]
    qkv_e = torch.randn(T, width, generator=g).to(DEVICE, dtype) if extra else None
    positions = torch.randint(0, 64, (T,), generator=g).to(DEVICE)
    slots = torch.randperm(blocks * bs, generator=g)[:T].to(DEVICE)
    k_cache = torch.full((blocks, bs, KVH, D), float("nan"), dtype=dtype, device=DEVICE)
    v_cache = torch.full_like(k_cache, float("nan"))
    q_out = torch.full((T, H, D), float("nan"), dtype=dtype, device=DEVICE)
    rope_and_cache(qkv, positions, slots, rope.cos, rope.sin, q_out, k_cache, v_cache, qkv_e)
    q, k, v = (qkv if qkv_e is None else qkv + qkv_e).split([H * D, KVH * D, KVH * D], dim=-1)
    _close(q_out, rope.apply(q.reshape(T, H, D), positions), dtype)
    _close(k_cache.view(-1, KVH, D)[slots], rope.apply(k.reshape(T, KVH, D), positions), dtype)
    assert torch.equal(v_cache.view(-1, KVH, D)[slots], v.reshape(T, KVH, D))
    untouched = torch.ones(blocks * bs, dtype=torch.bool, device=DEVICE)
    untouched[slots] = False
    assert torch.isnan(k_cache.view(-1, KVH, D)[untouched]).all()      # nothing written elsewhere


@pytest.mark.parametrize("dtype", DTYPES)
def test_norm_and_swiglu_add_an_extra_as_torch_would_before_them(dtype):
    """The 2-16-token LoRA delta from the side stream (`LlamaModel._project`): the kernels that read a
    projection's output add it first, as `y.add_(delta)` would have, and leave y and the delta as they were
    (RoPE + cache write: `test_rope_and_cache`)."""
    g = _gen()
    T, H, inter = 3, 64, 80
    x, r, e = (torch.randn(T, H, generator=g).to(DEVICE, dtype) for _ in range(3))
    w = (1 + 0.2 * torch.randn(H, generator=g)).to(DEVICE, dtype)
    x0, e0, res = x.clone(), e.clone(), r.clone()
    out = torch.full_like(x, float("nan"))
    add_rms_norm(x, res, w, 1e-5, out, res, extra=e)
    _close(res, r + (x + e), dtype)
    _close(out, rms_norm(r + (x + e), w, 1e-5), dtype)
    assert torch.equal(x, x0) and torch.equal(e, e0)
    gu, gu_e = (torch.randn(T, 2 * inter, generator=g).to(DEVICE, dtype) for _ in range(2))
    act = torch.full((T, inter), float("nan"), dtype=dtype, device=DEVICE)
    silu_mul(gu, act, extra=gu_e)
    both = gu + gu_e
    _close(act, F.silu(both[:, :inter]) * both[:, inter:], dtype)
    with pytest.raises(ValueError, match="extra must be"):
        silu_mul(gu, act, extra=gu_e[:, :inter])


@pytest.mark.gpu
def test_fused_ops_bf16_bit_exact_mostly():
    """bf16 on the GPU: the fused ops round like torch, so nearly every element is bit-identical."""
    g = _gen()
    x = torch.randn(64, 4096, generator=g).to("cuda", torch.bfloat16)
    w = (1 + 0.2 * torch.randn(4096, generator=g)).to("cuda", torch.bfloat16)
    out = torch.empty_like(x)
    add_rms_norm(x, None, w, 1e-5, out)
    assert (out == rms_norm(x, w, 1e-5)).float().mean() > 0.99
    gu = torch.randn(64, 2 * 14336, generator=g).to("cuda", torch.bfloat16)
    act = torch.empty(64, 14336, dtype=torch.bfloat16, device="cuda")
    silu_mul(gu, act)
    assert (act == F.silu(gu[:, :14336]) * gu[:, 14336:]).float().mean() > 0.99
