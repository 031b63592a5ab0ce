"""CUDA-graph safety: a captured shrink -> expand replays correctly after the metadata changes."""
import pytest
import torch

from kernels import LoraBatchMeta
from kernels.expand import lora_expand_triton
from kernels.shrink import lora_shrink_triton
from lora_case import build_case, dense_expand, dense_shrink, random_slot_ids, rel_err


MODS, OFFS = [0, 1, 2], [0, 4096, 5120, 6144]      # q/k/v slices of one fused output


def _setup(T):
    """A generator, a 10-adapter bf16 q/k/v case of mixed ranks on one layer, and batch metadata for T tokens."""
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    ranks = {s: [[8, 16, 64][(s + i) % 3] for i in range(3)] for s in range(10)}
    case = build_case(ranks=ranks, h_in=4096, outs=[4096, 1024, 1024], num_layers=1, max_slots=16,
                      dtype=torch.bfloat16, gen=gen, page_elems=4096 * 4)
    return gen, case, LoraBatchMeta(T, 16, device="cuda")


def _inputs(T):
    return (torch.empty(T, 4096, dtype=torch.bfloat16, device="cuda"),
            torch.empty(T, 6144, dtype=torch.bfloat16, device="cuda"))


def _check(case, x, y, y0, ids, frac_none, tol):
    """y equals the dense reference within `tol`, and rows with no adapter kept y0 exactly."""
    want_s, _ = dense_shrink(case, x, ids, 0, MODS)
    want = dense_expand(case, want_s, y0, ids, 0, MODS, OFFS)
    assert rel_err(y, want) < tol, frac_none
    assert torch.equal(y.cpu()[ids < 0], y0[ids < 0])


def _capture(step):
    """`step` run once on a side stream (compiles outside the capture), then captured in a graph."""
    from compute_service.engine.graph_capture import capture
    return capture(step, None)[0]

def _replays(graph, fracs_none, T, meta, x, y, gen, ids_to_cuda):
    """Per fraction of adapter-less tokens: new slot ids, inputs and y, one replay; yields (frac, ids, y before)."""
    for frac_none in fracs_none:
        ids = random_slot_ids(T, list(range(10)), frac_none, gen)
        meta.prepare(ids.cuda() if ids_to_cuda else ids)
        x.copy_(torch.randn(T, 4096, generator=gen))
        y0 = torch.randn(T, 6144, generator=gen).to(torch.bfloat16)
        y.copy_(y0)
        graph.replay()
        torch.cuda.synchronize()
        yield frac_none, ids, y0


@pytest.mark.gpu
@pytest.mark.parametrize("T", [8, 256])
@pytest.mark.parametrize("pdl", [False, True])
def test_graph_replay_follows_new_metadata(T, pdl):
    gen, case, meta = _setup(T)
    x, y = _inputs(T)
    s = torch.empty(3, T, case.tables.max_rank, device="cuda")

    cfg = {"PDL": 1} if pdl else None       # programmatic dependent launch between the two kernels

    def step():
        lora_shrink_triton(x, case.pool, case.tables, meta, 0, MODS, s, config=cfg)
        lora_expand_triton(s, case.pool, case.tables, meta, 0, MODS, y, OFFS, config=cfg)

    meta.prepare(random_slot_ids(T, [0, 1], 0.0, gen).cuda())
    x.copy_(torch.randn(T, 4096, generator=gen))
    y.normal_()
    graph = _capture(step)
    for frac_none, ids, y0 in _replays(graph, (0.0, 0.5, 1.0), T, meta, x, y, gen, ids_to_cuda=True):
        _check(case, x, y, y0, ids, frac_none, tol=1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 8, 64, 256])
def test_fused_graph_replay_follows_new_metadata(T):
    """One fused launch per group in a graph; the host only re-prepares (copies slot ids) between replays."""
    from kernels.fused import fused_workspace, lora_fused_triton

    gen, case, meta = _setup(T)
    ws = fused_workspace(T, 64, "cuda")
    x, y = _inputs(T)

    def step():
        lora_fused_triton(x, case.pool, case.tables, meta, 0, MODS, y, OFFS, ws)

    meta.prepare(random_slot_ids(T, [0, 1], 0.0, gen))
    x.normal_()
    y.normal_()
    graph = _capture(step)
    for frac_none, ids, y0 in _replays(graph, (0.0, 0.5, 1.0, 0.1), T, meta, x, y, gen, ids_to_cuda=False):
        _check(case, x, y, y0, ids, frac_none, tol=1.5e-2)
        assert not ws[0].any() and not ws[1].any()
