"""Batch metadata: segments group every adapter's tokens, in place, without host sync on device ids."""
import pytest
import torch

from kernels import LoraBatchMeta
from lora_case import DEVICE


def _check(meta: LoraBatchMeta, slot_ids: torch.Tensor) -> None:
    n = int(meta.num_segments.item())
    starts = meta.seg_starts.cpu().tolist()
    slots = meta.seg_slots.cpu().tolist()
    order = meta.token_indices[: meta.num_tokens].cpu().tolist()
    expected_slots = sorted(set(s for s in slot_ids.tolist() if s >= 0))
    assert slots[:n] == expected_slots and all(s == -1 for s in slots[n:])
    for i, slot in enumerate(expected_slots):
        toks = order[starts[i]: starts[i + 1]]
        assert toks == [t for t, s in enumerate(slot_ids.tolist()) if s == slot]   # stable, complete
    assert starts[n] == int((slot_ids >= 0).sum()) and all(v == starts[n] for v in starts[n:])


@pytest.mark.parametrize("frac_none", [0.0, 0.4, 1.0])
@pytest.mark.parametrize("on_device", [False, True])
def test_segments_match_slot_ids(frac_none, on_device):
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    meta = LoraBatchMeta(64, 16, device=DEVICE)
    ptrs = [t.data_ptr() for t in (meta.token_indices, meta.seg_starts, meta.seg_slots, meta.num_segments)]
    for T in (1, 37, 64, 5):
        ids = torch.randint(0, 16, (T,), generator=gen, dtype=torch.int32)
        ids[torch.rand(T, generator=gen) < frac_none] = -1
        meta.prepare(ids.to(DEVICE) if on_device else ids)
        _check(meta, ids)
        assert meta.num_tokens == T
        if not on_device or DEVICE == "cpu":
            assert meta.has_lora == bool((ids >= 0).any())
    # Refilled in place: graphs captured against these tensors stay valid.
    assert ptrs == [t.data_ptr() for t in (meta.token_indices, meta.seg_starts, meta.seg_slots, meta.num_segments)]


def test_empty_batch_and_bad_ids():
    meta = LoraBatchMeta(8, 4)
    meta.prepare(torch.empty(0, dtype=torch.int32))
    assert meta.num_tokens == 0 and meta.has_lora is False and int(meta.num_segments) == 0
    with pytest.raises(ValueError, match="exceed max_tokens"):
        meta.prepare(torch.zeros(9, dtype=torch.int32))
    with pytest.raises(ValueError, match="slot ids must lie in"):
        meta.prepare(torch.tensor([0, 4], dtype=torch.int32))
    with pytest.raises(ValueError, match="1-D"):
        meta.prepare(torch.zeros(2, 2, dtype=torch.int32))


@pytest.mark.parametrize("max_slots", [1, 16, 100])
def test_device_build_matches_host_build(max_slots):
    """The segments kernel (Triton's interpreter on CPU) fills exactly what the host build fills."""
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    host = LoraBatchMeta(300, max_slots, device="cpu", device_build=False)
    dev = LoraBatchMeta(300, max_slots, device=DEVICE, device_build=True)
    for T, frac_none in ((0, 0.0), (1, 0.0), (45, 0.3), (300, 0.1), (7, 1.0)):
        ids = torch.randint(0, max_slots, (T,), generator=gen, dtype=torch.int32)
        ids[torch.rand(T, generator=gen) < frac_none] = -1
        host.prepare(ids)
        dev.prepare(ids)
        _check(dev, ids)
        assert torch.equal(dev.token_indices[:T].cpu(), host.token_indices[:T])     # no-adapter tokens last too
        assert torch.equal(dev.seg_starts.cpu(), host.seg_starts) and torch.equal(dev.seg_slots.cpu(), host.seg_slots)
        assert dev.segments_cpu() == host.segments_cpu() and dev.has_lora == host.has_lora
