"""x's pairs form for the one-row float16-pairs kernels (`kernels.quant_x_pairs`): its launch and the two kernels
that write it with x (the norm, the SwiGLU) against the torch reference bit for bit, and the one-row kernels
reading it against converting x themselves, bit for bit (the same float16 sums in the same order).

On the CPU in Triton's interpreter with small shapes; the `gpu` cases take the 8B's down shape at pick_config.
"""
import pytest
import torch

from kernels.quant_matmul import QuantMatmulConfig, launch_split, pick_config, quant_matmul, reads_pairs
from kernels.quant_pack import pack_quantized
from kernels.quant_x_pairs import check_pairs, pairs_mode, pairs_width, x_pairs, x_pairs_into, x_pairs_reference
from kernels.reference import quant_matmul_ref
from kernels.silu_mul import silu_mul

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _x(t: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """bfloat16 x with values float16 cannot hold unscaled (1e5), below its normal range once divided by 16
    (1e-5: subnormal pairs), and zeros."""
    x = torch.randn(t, k, generator=gen) * 3
    x[0, 3], x[0, 10], x[-1, 7], x[-1, 8] = 1e5, 1e-5, -7e4, 0.0
    return x.to(torch.bfloat16).to(DEVICE)


def _weight(n: int, k: int, group: int, gen: torch.Generator):
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)
    s = (torch.rand(n, k // group, generator=gen) * 0.02 + 0.002).half()
    o = (-torch.rand(n, k // group, generator=gen) * 8 * 0.02).half()
    return q.to(DEVICE), s.to(DEVICE), o.to(DEVICE)


WHERE = ["any", pytest.param("gpu", marks=pytest.mark.gpu)]     # "gpu": in the GPU suites (`-m gpu`) too


@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("k", [256, 1280])
def test_launch_writes_the_reference_form(k: int, where: str) -> None:
    """Every pair word and quad sum as the reference computes them (1280: five blocks, a program's four and one),
    1e5 among the values (compiled, a multiply and a conversion to float16 written plainly overflowed there)."""
    x = _x(3, k, torch.Generator().manual_seed(k))
    got = x_pairs(x)
    assert got.shape == (3, pairs_width(k)) == (3, k // 2 + k // 16)
    assert torch.equal(got.cpu(), x_pairs_reference(x.cpu()))


def _one_row(x, w, cfg, pairs, addend=None):
    n = w.out_features
    out = torch.full((1, n), float("nan"), dtype=x.dtype, device=DEVICE)
    part = torch.full((cfg.split_k * n,), float("nan"), device=DEVICE)
    locks = torch.zeros(64, dtype=torch.int32, device=DEVICE)
    quant_matmul(x, w, None, out, cfg, part, locks, addend=None if addend is None else addend.clone(),
                 x_pairs=pairs)
    assert int(locks.abs().sum()) == 0
    return out


@pytest.mark.parametrize("group,k,split", [(128, 768, 1), (128, 1792, 3), (256, 1280, 2)])
@pytest.mark.parametrize("n", [64, 41])
def test_one_row_kernel_reads_the_form_bit_for_bit(group: int, k: int, split: int, n: int) -> None:
    """64-feature programs of the register-set kernel (the rule's own case; a partial program at 41 rows), 3 to 7
    blocks split into odd and even counts, with a LoRA addend: the same output with the form as without it, and
    both right against the fp32 reference."""
    gen = torch.Generator().manual_seed(k + n)
    q, s, o = _weight(n, k, group, gen)
    w = pack_quantized(q, s, o, 4, group)
    x = _x(1, k, gen)
    cfg = QuantMatmulConfig(64, 1, split)
    assert reads_pairs(cfg, w, x.dtype)
    add = torch.randn(1, n, generator=gen).to(DEVICE)
    plain = _one_row(x, w, cfg, None, add)
    ready = _one_row(x, w, cfg, x_pairs(x), add)
    assert torch.equal(plain, ready)
    want = quant_matmul_ref(x, q, s, o).cpu() + add.cpu()
    assert ((ready.cpu().float() - want).norm() / want.norm()).item() < 1e-2


@pytest.mark.parametrize("cfg", [QuantMatmulConfig(128, 1, 2), QuantMatmulConfig(64, 1, 2, tma_stages=2)])
def test_the_rule_and_its_switch(cfg: QuantMatmulConfig, monkeypatch) -> None:
    """Where the rule says the form does not pay (128-feature programs, the TMA-read kernel) a launch ignores it (a
    form of zeros changes nothing); LORAPLEX_X_PAIRS=all reads it there too (the zeros then show, and the true form
    gives the same output bit for bit); 0 ignores it everywhere."""
    gen = torch.Generator().manual_seed(3)
    q, s, o = _weight(128, 512, 128, gen)
    w = pack_quantized(q, s, o, 4, 128)
    x = _x(1, 512, gen)
    zeros = torch.zeros(1, pairs_width(512), dtype=torch.int32, device=DEVICE)
    plain = _one_row(x, w, cfg, None)
    assert not reads_pairs(cfg, w, x.dtype)
    assert torch.equal(_one_row(x, w, cfg, zeros), plain)
    monkeypatch.setenv("LORAPLEX_X_PAIRS", "all")
    assert reads_pairs(cfg, w, x.dtype)
    assert not torch.equal(_one_row(x, w, cfg, zeros), plain)
    assert torch.equal(_one_row(x, w, cfg, x_pairs(x)), plain)
    monkeypatch.setenv("LORAPLEX_X_PAIRS", "0")
    assert not reads_pairs(QuantMatmulConfig(64, 1, 2), w, x.dtype)
    monkeypatch.setenv("LORAPLEX_X_PAIRS", "2")
    with pytest.raises(ValueError, match="LORAPLEX_X_PAIRS"):
        pairs_mode()


@pytest.mark.parametrize("where", WHERE)
def test_producers_write_the_form(where: str) -> None:
    """The norm and the SwiGLU (from a split launch's partials, and gathering into an act-order) write their output's
    form where handed an int32 buffer, as the reference computes it from what they wrote."""
    from kernels.perm import gather_columns
    from kernels.rms_norm import add_rms_norm
    from kernels.split_sum import SplitSum

    gen = torch.Generator().manual_seed(4)
    t, h, inter = 2, 512, 768
    x = _x(t, h, gen)
    res = _x(t, h, gen)
    weight = (torch.rand(h, generator=gen) + 0.5).to(torch.bfloat16).to(DEVICE)
    out = torch.empty_like(x)
    form = torch.full((t, pairs_width(h)), -1, dtype=torch.int32, device=DEVICE)
    add_rms_norm(x, res, weight, 1e-5, out, res.clone(), form)
    assert torch.equal(form.cpu(), x_pairs_reference(out.cpu()))

    parts = (torch.randn(2, t, 2 * inter, generator=gen) * 2).to(DEVICE)
    act = torch.empty(t, inter, dtype=torch.bfloat16, device=DEVICE)
    form = torch.full((t, pairs_width(inter)), -1, dtype=torch.int32, device=DEVICE)
    silu_mul(SplitSum(parts, torch.bfloat16), act, form)
    assert torch.equal(form.cpu(), x_pairs_reference(act.cpu()))
    perm = torch.randperm(inter, generator=gen).to(torch.int32).to(DEVICE)
    model_act = torch.empty_like(act)
    silu_mul(SplitSum(parts, torch.bfloat16), act, form, perm=perm, model_out=model_act)
    assert torch.equal(act, gather_columns(model_act, perm))
    assert torch.equal(form.cpu(), x_pairs_reference(act.cpu()))


def test_checks() -> None:
    x = _x(1, 512, torch.Generator().manual_seed(5))
    with pytest.raises(ValueError, match="multiple of 256"):
        check_pairs(torch.zeros(1, 100, dtype=torch.int32), 1, 320)
    with pytest.raises(ValueError, match="int32"):
        x_pairs_into(x, torch.zeros(1, pairs_width(512), dtype=torch.float32, device=DEVICE))
    with pytest.raises(ValueError, match="x pairs"):
        silu_mul(torch.zeros(1, 1024, dtype=torch.bfloat16, device=DEVICE),
                 torch.empty(1, 512, dtype=torch.bfloat16, device=DEVICE),
                 torch.zeros(1, pairs_width(256), dtype=torch.int32, device=DEVICE))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_8b_down_reads_the_form_bit_for_bit() -> None:
    """The 8B's down (N 4096, K 14336) at pick_config's one-row choice, compiled: the form is read there, and the
    output (the partials its launch leaves, and a plain launch's) is the same bit for bit."""
    gen = torch.Generator().manual_seed(6)
    n, k = 4096, 14336
    q, s, o = _weight(n, k, 128, gen)
    w = pack_quantized(q, s, o, 4, 128)
    x = _x(1, k, gen)
    cfg = pick_config(1, n, k, 4, torch.cuda.get_device_properties(0).multi_processor_count, 128)
    assert reads_pairs(cfg, w, x.dtype), cfg
    form = x_pairs(x)
    assert torch.equal(form.cpu(), x_pairs_reference(x.cpu()))
    split = launch_split(cfg, w)
    for defer in (False, True):
        outs = []
        for pairs in (None, form):
            out = torch.full((1, n), float("nan"), dtype=x.dtype, device=DEVICE)
            part = torch.full((split * n,), float("nan"), device=DEVICE)
            locks = torch.zeros(1024, dtype=torch.int32, device=DEVICE)
            quant_matmul(x, w, None, out, cfg, part, locks, defer_split=defer, x_pairs=pairs)
            outs.append(part.clone() if defer else out.clone())
        assert torch.equal(outs[0], outs[1])
    want = quant_matmul_ref(x, q, s, o)
    assert ((outs[1].view(split, n).sum(0).float() - want.view(-1)).norm() / want.norm()).item() < 1e-2
