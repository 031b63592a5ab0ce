"""Sampled tokens reach the host without waiting for GPU work queued after them (`TokenReadback`)."""
import pytest
import torch

from compute_service.engine.readback import RING, TokenReadback


def test_reads_return_each_steps_tokens_through_the_ring():
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    rb = TokenReadback(8, torch.device(dev))
    steps = [torch.arange(i, i + 1 + i % 8, dtype=torch.int64, device=dev) for i in range(3 * RING)]
    pending = []
    for i, t in enumerate(steps):
        pending.append(rb.start(t))
        if i >= 1:      # overlapped steps: the previous step is read after this one was started
            assert pending[i - 1].read() == steps[i - 1].tolist()
    assert pending[-1].read() == steps[-1].tolist()
    with pytest.raises(ValueError, match="exceed"):
        rb.start(torch.zeros(9, dtype=torch.int64, device=dev))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_read_does_not_wait_for_work_queued_after_it():
    rb = TokenReadback(4, torch.device("cuda"))
    tokens = torch.tensor([3, 1, 4], device="cuda")
    pending = rb.start(tokens)
    torch.cuda._sleep(2_000_000_000)              # ~1 s of GPU time queued behind the copy (the next step)
    after = torch.cuda.Event()
    after.record()
    assert pending.read() == [3, 1, 4]
    assert not after.query(), "the read waited for the work queued after the copy"
    torch.cuda.synchronize()
