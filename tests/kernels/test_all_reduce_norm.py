"""The fused all-reduce + residual add + RMSNorm of tensor parallelism (kernels/all_reduce_norm.py).

On the CPU (Triton's interpreter) the ranks cannot run at once, so each rank's launch runs alone with
its peers already arrived: their rows already in their buffers, their flags already in its pad. That
checks the addressing of both buffer halves, the rank-order sum, the add + norm against `add_rms_norm`,
and the flag bookkeeping (its own flags cleared, one flag set in every peer's pad per row). Two real
ranks on two GPUs: tests/parallel/tp_gpu_worker.py."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels.all_reduce_norm import reduce_add_rms_norm
from kernels.rms_norm import add_rms_norm

T, H, EPS = 5, 40, 1e-5
# The interpreter where there is no GPU, the compiled kernel on one GPU where there is (`gpu` stages).
DEVICES = [pytest.param("cpu", marks=pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter: CPU hosts")),
           pytest.param("cuda", marks=pytest.mark.gpu)]


def _ptrs(tensors, dev):
    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64, device=dev)


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("slot", [0, 1])
def test_one_rank_is_add_rms_norm(dev, dtype, slot):
    g = torch.Generator().manual_seed(slot)
    x, h = torch.randn(T, H, generator=g).to(dev, dtype), torch.randn(T, H, generator=g).to(dev, dtype)
    w = torch.randn(H, generator=g).to(dev, dtype)
    half = T * H + 3
    buf = torch.zeros(2 * half, dtype=dtype, device=dev)
    pad = torch.zeros(T, dtype=torch.int32, device=dev)
    got_h, got = h.clone(), torch.empty_like(x)
    status = torch.zeros(1, dtype=torch.int32, device=dev)
    reduce_add_rms_norm(x, got_h, w, EPS, got, _ptrs([buf], dev), _ptrs([pad], dev), slot * half, 0, status)
    want_h, want = h.clone(), torch.empty_like(x)
    add_rms_norm(x, want_h, w, EPS, want, want_h)
    assert torch.equal(got_h, want_h) and torch.equal(got, want)
    assert torch.equal(buf[slot * half: slot * half + T * H].view(T, H), x)     # its row went to its half
    assert not buf[(1 - slot) * half: (1 - slot) * half + T * H].any()           # the other half untouched
    assert not pad.any() and not status.any()


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("rank", [0, 1, 2])
def test_a_rank_sums_every_rank_in_rank_order_and_keeps_the_flags(dev, rank):
    world, dtype, slot = 3, torch.float32, 1
    g = torch.Generator().manual_seed(7)
    parts = [(torch.randn(T, H, generator=g) * 10 ** p).to(dev) for p in range(world)]   # order-sensitive
    h = torch.randn(T, H, generator=g).to(dev)
    w = torch.randn(H, generator=g).to(dev)
    half = T * H
    bufs = [torch.full((2 * half,), float("nan"), device=dev) for _ in range(world)]
    pads = [torch.zeros(T * world, dtype=torch.int32, device=dev) for _ in range(world)]
    for p in range(world):
        if p != rank:
            bufs[p][slot * half: (slot + 1) * half] = parts[p].flatten()       # the peers' rows are there
            pads[rank][torch.arange(T, device=dev) * world + p] = 1   # and they have arrived
    got_h, got = h.clone(), torch.empty(T, H, device=dev)
    status = torch.zeros(1, dtype=torch.int32, device=dev)
    reduce_add_rms_norm(parts[rank], got_h, w, EPS, got, _ptrs(bufs, dev), _ptrs(pads, dev), slot * half, rank,
                        status)
    total = parts[0].clone()
    for p in range(1, world):
        total = total + parts[p]
    want_h, want = h.clone(), torch.empty(T, H, device=dev)
    add_rms_norm(total.to(dtype), want_h, w, EPS, want, want_h)
    assert torch.equal(got_h, want_h) and torch.equal(got, want)
    assert not pads[rank].any() and not status.any()                              # its flags taken
    for p in range(world):
        if p != rank:
            flags = torch.zeros(T * world, dtype=torch.int32, device=dev)
            flags[torch.arange(T, device=dev) * world + rank] = 1
            assert torch.equal(pads[p], flags)                                    # one per row, at its index


@pytest.mark.parametrize("dev", DEVICES)
def test_mismatched_shapes_are_refused(dev):
    x = torch.zeros(2, 8, device=dev)
    with pytest.raises(ValueError, match="one shape"):
        reduce_add_rms_norm(x, torch.zeros(3, 8, device=dev), torch.ones(8, device=dev), EPS, torch.zeros_like(x),
                            _ptrs([x], dev), _ptrs([x], dev), 0, 0, torch.zeros(1, dtype=torch.int32, device=dev))
    with pytest.raises(ValueError, match="rank"):
        reduce_add_rms_norm(x, torch.zeros_like(x), torch.ones(8, device=dev), EPS, torch.zeros_like(x),
                            _ptrs([x, x], dev), _ptrs([x], dev), 0, 0, torch.zeros(1, dtype=torch.int32, device=dev))


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter: CPU hosts (on a GPU: the trap test below)")
def test_a_peer_that_never_arrives_is_given_up_on_and_recorded():
    """Rank 0 of 2 whose peer never sets its flag: the program stops waiting after its bound of tries
    (the interpreter has no clock) and records it, instead of spinning forever."""
    x, h = torch.ones(2, 8), torch.zeros(2, 8)
    buf, pad, status = torch.zeros(2 * 16), torch.zeros(4, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    reduce_add_rms_norm(x, h, torch.ones(8), EPS, torch.empty_like(x), _ptrs([buf, buf], "cpu"),
                        _ptrs([pad, torch.zeros(4, dtype=torch.int32)], "cpu"), 0, 0, status, timeout_s=0.01)
    assert status.item() == 1


_NEVER_ARRIVES = """
import sys, time, torch
from kernels.all_reduce_norm import reduce_add_rms_norm
dev = torch.device("cuda")
x, h = torch.ones(2, 64, device=dev), torch.zeros(2, 64, device=dev)
buf, pads = torch.zeros(2 * 128, device=dev), [torch.zeros(4, dtype=torch.int32, device=dev) for _ in range(2)]
ptrs = lambda ts: torch.tensor([t.data_ptr() for t in ts], dtype=torch.int64, device=dev)
status = torch.zeros(1, dtype=torch.int32, device=dev)
t0 = time.monotonic()
reduce_add_rms_norm(x, h, torch.ones(64, device=dev), 1e-5, torch.empty_like(x), ptrs([buf, buf]), ptrs(pads), 0, 0,
                    status, timeout_s=0.5)
try:
    torch.cuda.synchronize()
except Exception as e:
    print("failed after %.1f s: %s" % (time.monotonic() - t0, type(e).__name__), flush=True)
    sys.exit(3)
print("returned", status.item(), flush=True)
"""


@pytest.mark.gpu
def test_on_a_gpu_a_peer_that_never_arrives_ends_the_context_instead_of_hanging():
    """Compiled, the program traps once it has waited timeout_s: the CUDA context ends with an error the
    host sees at its next synchronisation (here within seconds), so a dead rank cannot hang the GPU."""
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", _NEVER_ARRIVES], cwd=root, capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.returncode == 3, (proc.returncode, proc.stdout, proc.stderr[-2000:])
    assert "failed after" in proc.stdout
