"""The L2 prefetch's chunk table (kernels/l2_prefetch.py): chunks cover exactly the 16-byte-widened ranges, sized
to spread over the programs asked for; row ranges of a tensor; no launch where the device cannot run it."""
from __future__ import annotations

import torch

from kernels.l2_prefetch import CHUNKS_A_PROGRAM, MAX_CHUNK, MIN_CHUNK, chunk_table, l2_prefetch, tensor_rows


def _covered(table: torch.Tensor) -> list[tuple[int, int]]:
    spans: list[tuple[int, int]] = []
    for addr, size in table.tolist():
        if spans and spans[-1][1] == addr:
            spans[-1] = (spans[-1][0], addr + size)
        else:
            spans.append((addr, addr + size))
    return spans


def test_chunks_cover_the_widened_ranges_and_nothing_else():
    ranges = [(1_000_003, 700_001), (5_000_000, 16), (9_000_000, 0)]
    table = chunk_table(ranges, programs=4, device=torch.device("cpu"))
    assert table.dtype == torch.int64 and table.shape[1] == 2
    assert all(a % 16 == 0 and s % 16 == 0 and 0 < s <= MAX_CHUNK for a, s in table.tolist())
    assert _covered(table) == [(1_000_000, 1_700_016), (5_000_000, 5_000_016)]


def test_chunk_size_spreads_over_the_programs_within_bounds():
    big = chunk_table([(0, 64 * 2**20)], programs=132, device=torch.device("cpu"))
    assert 132 * CHUNKS_A_PROGRAM <= big.shape[0] <= 132 * CHUNKS_A_PROGRAM + 1
    small = chunk_table([(0, 10 * MIN_CHUNK)], programs=132, device=torch.device("cpu"))
    assert small[:, 1].max().item() == MIN_CHUNK and small.shape[0] == 10
    huge = chunk_table([(0, 2**33)], programs=1, device=torch.device("cpu"))
    assert huge[:, 1].max().item() == MAX_CHUNK


def test_tensor_rows_are_a_row_range():
    t = torch.zeros(10, 24, dtype=torch.int32)
    assert tensor_rows(t, 0.0, 1.0) == (t.data_ptr(), t.nbytes)
    assert tensor_rows(t, 0.5, 0.8) == (t.data_ptr() + 5 * 96, 3 * 96)
    try:
        tensor_rows(t.t(), 0.0, 1.0)
    except ValueError as e:
        assert "contiguous" in str(e)
    else:
        raise AssertionError("a strided tensor's rows are not one range")


def test_no_launch_on_the_cpu():
    l2_prefetch(chunk_table([(0, 4096)], 1, torch.device("cpu")))      # would fault if it launched: nothing runs
