"""The tensor-core pair-codes path with its words read by TMA, a half block a step (`kernels.quant_mma_tma`:
`QuantMatmulConfig.tma_stages` with 2+ rows) against the fp32 dequantize-then-matmul reference: several token
tiles, feature tiles with partial ones (TMA fills rows past N with zeros), split-K with odd block counts and a K
of whole blocks plus a half (the last block's second half past K), groups of 128 and 256, a bias, both 16-bit
dtypes; and which kernel a config launches."""
import pytest
import torch

from kernels.quant_matmul import QuantMatmulConfig

from test_quant_matmul import check


@pytest.mark.parametrize("stages", [2, 4])
@pytest.mark.parametrize("T,N,K,group,split,bm", [(5, 64, 512, 128, 1, 16), (40, 72, 1664, 128, 3, 16),
                                                  (33, 40, 768, 256, 2, 64)])
def test_tma_tiles_match_reference(stages: int, T: int, N: int, K: int, group: int, split: int, bm: int) -> None:
    for dtype, bias in ((torch.bfloat16, True), (torch.float16, False)):
        check(T, N, K, 4, group, dtype, bias, QuantMatmulConfig(32 if N < 64 else 64, bm, split, tma_stages=stages))


def test_a_tile_config_with_tma_stages_launches_the_tma_kernel(monkeypatch) -> None:
    """tma_stages > 0 on the pair-codes path launches `quant_mma_tma_kernel` with those stages; 0, or a layout
    off that path (groups of 32), the register-set tiles; LORAPLEX_TILE_TMA overrides the config's stages (0: the
    register-set tiles) on that path only, and bad values are refused with the variable's name."""
    import kernels.quant_matmul as qm

    launched = []

    class Recorder:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *a, **kw: launched.append((self.name, kw.get("STAGES")))

    monkeypatch.setattr(qm, "quant_mma_tma_kernel", Recorder("tma"))
    monkeypatch.setattr(qm, "quant_mma_kernel", Recorder("tiles"))
    monkeypatch.delenv("LORAPLEX_TILE_TMA", raising=False)
    cases = [(None, 128, 3, ("tma", 3)), (None, 128, 0, ("tiles", None)), (None, 32, 3, ("tiles", None)),
             ("4", 128, 0, ("tma", 4)), ("4", 128, 2, ("tma", 4)), ("0", 128, 3, ("tiles", None)),
             ("4", 32, 0, ("tiles", None))]
    for env, group, stages, want in cases:
        if env is None:
            monkeypatch.delenv("LORAPLEX_TILE_TMA", raising=False)
        else:
            monkeypatch.setenv("LORAPLEX_TILE_TMA", env)
        launched.clear()
        try:
            check(8, 64, 512, 4, group, torch.bfloat16, False, QuantMatmulConfig(64, 16, 1, tma_stages=stages))
        except AssertionError:
            pass                                 # nothing ran: the output is left as it was
        assert launched == [want], (env, group, stages, launched)
    for bad in ("x", "1", "9"):
        monkeypatch.setenv("LORAPLEX_TILE_TMA", bad)
        with pytest.raises(ValueError, match="LORAPLEX_TILE_TMA"):
            qm.tile_tma_override()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("N,K", [(6144, 4096), (4096, 14336)])
@pytest.mark.parametrize("T,split,stages", [(64, 1, 3), (33, 2, 5), (128, 1, 4), (17, 4, 2)])
def test_gpu_tma_tiles_8b_shapes(N: int, K: int, T: int, split: int, stages: int) -> None:
    """The 8B's q/k/v and down on the GPU (TMA on sm_90+; older GPUs take the register-set tiles), the token
    tiles pick_config would take at these rows."""
    bm = 16 if T <= 16 else 32 if T <= 32 else 64
    check(T, N, K, 4, 128, torch.bfloat16, False, QuantMatmulConfig(64, bm, split, tma_stages=stages))
