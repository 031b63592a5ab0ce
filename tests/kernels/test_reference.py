"""The torch reference (the CPU path) against dense per-token math on the unpaged weights."""
import pytest
import torch

from kernels import lora_apply_ref, lora_expand_ref, lora_shrink_ref
from lora_case import build_case, dense_expand, dense_shrink, prepare_meta, random_slot_ids, rel_err


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("use_meta", [True, False])
def test_reference_matches_dense(dtype, tol, use_meta):
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    case = build_case(ranks={1: [8, 0, 3], 4: [16, 5, 1], 6: [2, 2, 2]}, h_in=49, outs=[31, 20, 9],
                      dtype=dtype, device="cpu", gen=gen)
    T, mods, offs = 40, [0, 1, 2], [0, 31, 51, 60]
    ids = random_slot_ids(T, [1, 4, 6, 2], 0.3, gen)          # slot 2 holds no adapter: rank 0 everywhere
    batch = prepare_meta(ids, 8, "cpu") if use_meta else ids
    x = torch.randn(T, 49, generator=gen).to(dtype)
    s = torch.full((3, T, case.tables.max_rank), float("nan"))
    lora_shrink_ref(x, case.pool, case.tables, batch, 1, mods, s)
    want_s, defined = dense_shrink(case, x, ids, 1, mods)
    assert rel_err(s[defined], want_s[defined]) < 1e-5
    assert (s[~defined] == 0).all()
    y0 = torch.randn(T, 62, generator=gen).to(dtype)
    y = y0.clone()
    lora_expand_ref(s, case.pool, case.tables, batch, 1, mods, y, offs)
    want_y = dense_expand(case, s, y0, ids, 1, mods, offs)
    assert rel_err(y, want_y) < tol
    untouched = (ids < 0) | (ids == 2)
    assert torch.equal(y[untouched], y0[untouched]) and torch.equal(y[:, 60:], y0[:, 60:])
    y2 = y0.clone()
    lora_apply_ref(x, case.pool, case.tables, batch, 1, mods, y2, offs)
    assert torch.equal(y2, y)
