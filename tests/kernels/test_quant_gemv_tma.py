"""The one-row float16-pairs path with its words read by TMA (`kernels.quant_gemv_tma`, gate/up's pick) against the
fp32 dequantize-then-matmul reference: stages, scales a block ahead or not, split-K with odd block counts, partial
programs of rows (TMA fills rows past N with zeros), a bias; and the environment switch that turns it on in the
engine. Its LoRA addend: `test_quant_matmul.test_one_row_bf16_addend_and_large_x`."""
import pytest
import torch

from kernels.quant_matmul import QuantMatmulConfig, quant_matmul, tma_override
from kernels.quant_pack import pack_quantized
from kernels.reference import quant_matmul_ref

from test_quant_matmul import DEVICE, TOL, check, random_weight, rel_err


@pytest.mark.parametrize("stages,ahead", [(2, False), (3, True)])
@pytest.mark.parametrize("group,k,split", [(128, 512, 1), (128, 1792, 3), (256, 768, 2)])
def test_tma_path_matches_reference(stages: int, ahead: bool, group: int, k: int, split: int) -> None:
    check(1, 64, k, 4, group, torch.bfloat16, True, QuantMatmulConfig(64, 1, split, tma_stages=stages,
                                                                     scales_ahead=ahead))
    check(1, 41, k, 4, group, torch.bfloat16, False, QuantMatmulConfig(32, 1, split, tma_stages=stages,
                                                                      scales_ahead=ahead))


def test_tma_switch(monkeypatch) -> None:
    """LORAPLEX_H2_TMA=stages[,1] takes the TMA kernel where a config does not ask for it (the launch recorded
    from a stand-in), 0 keeps the register-set kernel where a config asks for TMA, bad values are refused with the
    variable's name, and unset each config decides."""
    import kernels.quant_matmul as qm

    monkeypatch.delenv("LORAPLEX_H2_TMA", raising=False)
    assert tma_override() is None
    for raw, want in (("4", (4, False)), ("3,1", (3, True)), ("0", (0, False))):
        monkeypatch.setenv("LORAPLEX_H2_TMA", raw)
        assert tma_override() == want
    for bad in ("x", "1", "9,1"):
        monkeypatch.setenv("LORAPLEX_H2_TMA", bad)
        with pytest.raises(ValueError, match="LORAPLEX_H2_TMA"):
            tma_override()
    gen = torch.Generator().manual_seed(32)
    q, s, o = random_weight(40, 512, 4, 128, gen)
    w = pack_quantized(q, s, o, 4, 128)
    x = torch.randn(1, 512, generator=gen).to(torch.bfloat16).to(DEVICE)
    out = torch.full((1, 40), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    launches = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append((kwargs["STAGES"], kwargs["SCALES_AHEAD"]))

    monkeypatch.setenv("LORAPLEX_H2_TMA", "4,1")
    with monkeypatch.context() as m:
        m.setattr(qm, "quant_gemv_tma_kernel", Recorder())
        quant_matmul(x, w, None, out, QuantMatmulConfig(64, 1, 1))
    assert launches == [(4, True)]
    monkeypatch.setenv("LORAPLEX_H2_TMA", "0")
    h2 = []

    class Plain:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: h2.append(kwargs["H2"])

    with monkeypatch.context() as m:
        m.setattr(qm, "quant_gemv_tma_kernel", Recorder())
        m.setattr(qm, "quant_gemv_kernel", Plain())
        quant_matmul(x, w, None, out, QuantMatmulConfig(64, 1, 1, tma_stages=2))
    assert launches == [(4, True)] and h2 == [True]
    monkeypatch.setenv("LORAPLEX_H2_TMA", "4,1")
    quant_matmul(x, w, None, out, QuantMatmulConfig(64, 1, 1))
    assert rel_err(out.cpu(), quant_matmul_ref(x, q, s, o).cpu()) < TOL[torch.bfloat16]


@pytest.mark.gpu
@pytest.mark.parametrize("n,k,split", [(6144, 4096, 8), (4096, 4096, 8), (28672, 4096, 1), (4096, 14336, 8)])
@pytest.mark.parametrize("stages,ahead", [(3, False), (4, True)])
def test_gpu_tma_8b_shapes(n: int, k: int, split: int, stages: int, ahead: bool) -> None:
    check(1, n, k, 4, 128, torch.bfloat16, n == 4096, QuantMatmulConfig(128, 1, split, tma_stages=stages,
                                                                        scales_ahead=ahead))
