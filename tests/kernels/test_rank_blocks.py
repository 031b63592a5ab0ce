"""Decode launches of the LoRA kernels are sized by rank blocks of at most 64 rows, not the pool's largest rank.

A pool accepts adapters up to `max_lora_rank` (256 by default); the adapters a step serves are often rank 8-16.
The launch configuration (grid, K split, tiles) may only depend on host-known shapes (CUDA graphs), so it must
not scale with the pool's largest rank: the kernels take an adapter's own rank at run time (rank-16 adapters in
small tiles, ranks above 64 block after block). The sums these paths compute are checked against dense math in
test_shrink.py / test_expand.py / test_fused.py (pools of rank 256 holding adapters of rank 1, 37 and 256).
"""
import pytest
import torch

from kernels.expand import expand_config
from kernels.fused import fused_config, fused_workspace, workspace_rank
from kernels.shrink import DECODE_MAX_TOKENS, shrink_config

CPU = torch.device("cpu")
LAUNCHES = [(4096, [4096, 1024, 1024]), (4096, [14336, 14336]), (14336, [4096])]   # 8B q/k/v, gate/up, down


@pytest.mark.parametrize("T", [1, 8, 16, 64, DECODE_MAX_TOKENS])
@pytest.mark.parametrize("K,widths", LAUNCHES)
def test_decode_launches_do_not_grow_with_the_pools_rank(T, K, widths):
    for big in (128, 256, 1024):
        assert fused_config(T, K, widths, big, 64, CPU, num_sms=132) == fused_config(T, K, widths, 64, 64, CPU,
                                                                                     num_sms=132)
        assert expand_config(T, big, widths, 64, CPU, 132) == expand_config(T, 64, widths, 64, CPU, 132)
        a, b = shrink_config(T, K, big, len(widths), 64, CPU), shrink_config(T, K, 64, len(widths), 64, CPU)
        # The same grid, K split and tiles: one rank-block program a slice and split, which walks an adapter's
        # further blocks itself (WALK_R) instead of a program per block of the pool's largest rank.
        assert a["R_BLOCKS"] == b["R_BLOCKS"] == 1 and a["WALK_R"] == 1 and b["WALK_R"] == 0
        assert {k: v for k, v in a.items() if k != "WALK_R"} == {k: v for k, v in b.items() if k != "WALK_R"}


def test_rank_blocks_are_at_most_64_rows_and_the_workspace_holds_the_pools_rank():
    for max_rank in (1, 16, 17, 64, 65, 256):
        assert fused_config(4, 4096, [4096], max_rank, 8, CPU, num_sms=132)["BLOCK_R"] == min(64, workspace_rank(
            max_rank))
        assert workspace_rank(max_rank) % min(64, workspace_rank(max_rank)) == 0
    sums, _ = fused_workspace(4, 256, CPU)
    assert sums.shape == (4, 4 * 256)


@pytest.mark.parametrize("T", [32, 64, DECODE_MAX_TOKENS])
def test_expand_takes_32_row_blocks_where_a_decode_launch_has_many_programs_an_sm(T):
    """At 32-128 tokens, an expand launch of five or more programs an SM (8B q/k/v, gate/up: 6-7 on 132 SMs)
    takes 32-row blocks in pools of ranks above 32; one of about four an SM (o, down) keeps 64 (a rank-64
    adapter would take two passes); pools up to 32 and prefill keep their blocks."""
    for widths, block_r in (([4096, 1024, 1024], 32), ([14336, 14336], 32), ([4096], 64)):
        for max_rank in (64, 256):
            assert expand_config(T, max_rank, widths, 64, CPU, 132)["BLOCK_R"] == block_r, (widths, max_rank)
        assert expand_config(T, 32, widths, 64, CPU, 132)["BLOCK_R"] == 32
        assert expand_config(T, 16, widths, 64, CPU, 132)["BLOCK_R"] == 16
    assert expand_config(256, 256, [14336, 14336], 64, CPU, 132)["BLOCK_R"] == 64


def test_prefill_shrink_keeps_a_program_per_rank_block():
    cfg = shrink_config(DECODE_MAX_TOKENS + 1, 4096, 256, 3, 64, CPU)
    assert cfg["R_BLOCKS"] == 4 and cfg["WALK_R"] == 0
