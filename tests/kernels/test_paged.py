"""Paged layout: rows land in the pages they are given, unpack returns them, memory follows rank."""
import numpy as np
import pytest
import torch

from kernels import LoraRowTables, clear_slot, pages_needed, rows_per_page, unpack, write_adapter
from lora_case import build_case


def test_roundtrip_scattered_pages_mixed_ranks():
    case = build_case(ranks={0: [1, 16, 0], 2: [64, 3, 7], 7: [256, 1, 2]}, h_in=65, outs=[40, 33, 17],
                      dtype=torch.float32, device="cpu", absent={(2, 1, 0)})
    assert (2, 1, 0) not in case.dense and int(case.tables.ranks[2, 1, 0]) == 0
    for (slot, layer, m), (a, b) in case.dense.items():
        got_a, got_b = unpack(case.pool, case.tables, slot, layer, m)
        assert torch.equal(got_a, a) and torch.equal(got_b, b)
        assert int(case.tables.ranks[slot, layer, m]) == a.shape[0]
    # Every row sits inside one page.
    for offsets, width_of in ((case.tables.a_offsets, lambda m: case.h_in), (case.tables.b_offsets, lambda m: case.outs[m])):
        for (slot, layer, m), (a, _) in case.dense.items():
            for off in offsets[slot, layer, m, : a.shape[0]].tolist():
                assert off % case.page_elems + width_of(m) <= case.page_elems


def test_pages_outside_the_grant_stay_untouched():
    tables = LoraRowTables(2, 1, 8, module_ids=(1,))
    page_elems = 200
    pool = torch.full((10 * page_elems,), 7.0)
    a, b = torch.randn(8, 50), torch.randn(30, 8)
    grant = [9, 2, 5, 0]                     # 8 rows of 50 -> 2 pages of 4, 8 rows of 30 -> 2 pages of 6
    assert pages_needed([(8, 50, 30)], page_elems) == 4
    write_adapter(pool, grant, [(1, 0, 8, a, b)], tables, 1, page_elems)
    pages = pool.view(10, page_elems)
    untouched = [p for p in range(10) if p not in grant]
    assert (pages[untouched] == 7.0).all()
    got_a, got_b = unpack(pool, tables, 1, 0, 0)
    assert torch.equal(got_a, a) and torch.equal(got_b, b)


def test_memory_follows_true_rank():
    page_elems = 4096 * 4
    shapes = lambda r: [(r, 4096, 4096)] * 7 * 32   # noqa: E731
    assert pages_needed(shapes(64), page_elems) == 8 * pages_needed(shapes(8), page_elems)
    assert rows_per_page(4096, page_elems) == 4
    with pytest.raises(ValueError, match="exceeds page_elems"):
        rows_per_page(page_elems + 1, page_elems)


def test_adapter_rows_from_converted_form_and_clear():
    Adapter = pytest.importorskip("loraplex.formats.adapter").Adapter
    fin, fout, rank = 24, 40, 4
    a1, b1 = torch.randn(rank, fin), torch.randn(fout, rank)
    a2, b2 = torch.randn(2, fin), torch.randn(fin, 2)
    width = rank * (fin + fout)
    w = torch.zeros(2, width)
    w[0] = torch.cat([a1.flatten(), b1.flatten()])
    w[1, : 2 * fin * 2] = torch.cat([a2.flatten(), b2.flatten()])
    adapter = Adapter(config=np.array([[1, 0, rank], [4, 1, 2]], dtype=np.int32), weights=w,
                      in_out=((fin, fout), (fin, fin)))
    tables = LoraRowTables(4, 2, 8)
    page_elems = 64
    shapes = [(r.rank, r.a.shape[1], r.b.shape[0]) for r in adapter.rows()]
    n = pages_needed(shapes, page_elems)
    pool = torch.zeros((n + 3) * page_elems, dtype=torch.float16)
    write_adapter(pool, list(range(3, n + 3)), adapter.rows(), tables, 3, page_elems)
    got_a, got_b = unpack(pool, tables, 3, 1, tables.module_index(4))
    torch.testing.assert_close(got_a.float(), a2.half().float())
    torch.testing.assert_close(got_b.float(), b2.half().float())
    clear_slot(tables, 3)
    assert int(tables.ranks[3].sum()) == 0
    with pytest.raises(ValueError, match="holds no adapter rows"):
        unpack(pool, tables, 3, 1, 3)


def test_bad_inputs_are_refused_with_a_reason():
    tables = LoraRowTables(2, 2, 8, module_ids=(1, 2))
    pool = torch.zeros(1000)
    a, b = torch.randn(4, 10), torch.randn(12, 4)
    with pytest.raises(ValueError, match="module id 9 is not served"):
        write_adapter(pool, [0, 1], [(9, 0, 4, a, b)], tables, 0, 100)
    with pytest.raises(ValueError, match="layer out of range"):
        write_adapter(pool, [0, 1], [(1, 5, 4, a, b)], tables, 0, 100)
    with pytest.raises(ValueError, match="rank 16 outside"):
        write_adapter(pool, [0, 1], [(1, 0, 16, torch.randn(16, 10), torch.randn(12, 16))], tables, 0, 100)
    with pytest.raises(ValueError, match="needs 2 pages"):
        write_adapter(pool, [0], [(1, 0, 4, a, b)], tables, 0, 100)
    with pytest.raises(ValueError, match="appears twice"):
        write_adapter(pool, [0, 1, 2], [(1, 0, 4, a, b), (1, 0, 4, a, b)], tables, 0, 100)
    with pytest.raises(ValueError, match="slot 2 out of range"):
        write_adapter(pool, [0, 1], [(1, 0, 4, a, b)], tables, 2, 100)
