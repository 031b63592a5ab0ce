"""kernels/sample.py: greedy rows are `torch.argmax` (ties to the first index, NaN ranked highest, -0 equal to +0,
rows over several chunks), sampled rows draw from softmax(logits / temperature) by their seed alone (the same
seed, the same token, whatever the batch), never a masked token. CPU in Triton's interpreter; GPU at the 8B's
vocabulary."""
from __future__ import annotations

import pytest
import torch

from kernels.sample import CHUNK, choose_tokens

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _gpu(device: str):
    return pytest.param(device, marks=pytest.mark.gpu) if device == "cuda" else device


@pytest.mark.parametrize("device", [_gpu(d) for d in DEVICES])
def test_greedy_rows_are_argmax(device):
    torch.manual_seed(0)
    vocab = 2 * CHUNK + 801
    logits = torch.randn(6, vocab)
    logits[1, 100] = logits[1, CHUNK + 5] = 50.0               # a tie across chunks: the first
    logits[2, 3000] = float("nan")                              # NaN ranks highest, as argmax
    logits[2, 9] = float("inf")
    logits[3] = -torch.rand(vocab) - 1
    logits[3, 40] = -0.0
    logits[3, 20] = 0.0                                         # -0 and +0 tie: the first (20)
    logits[4] = float("-inf")                                   # all -inf: index 0
    logits[5, -1] = 99.0                                        # the last token of a partial chunk
    logits = logits.to(device)
    assert choose_tokens(logits).tolist() == logits.argmax(-1).tolist()
    assert choose_tokens(logits.to(torch.bfloat16)).tolist() == logits.to(torch.bfloat16).argmax(-1).tolist()


@pytest.mark.parametrize("device", [_gpu(d) for d in DEVICES])
def test_mixed_rows_greedy_and_sampled(device):
    torch.manual_seed(1)
    logits = torch.randn(4, 700, device=device)
    temps = torch.tensor([0.0, 1.0, 0.0, 0.7], device=device)
    seeds = torch.tensor([0, 11, 0, 12], dtype=torch.int64, device=device)
    got = choose_tokens(logits, temps, seeds).tolist()
    assert got[0] == logits[0].argmax().item() and got[2] == logits[2].argmax().item()
    again = choose_tokens(logits, temps, seeds).tolist()
    assert again == got, "the same seeds, the same draws"
    alone = choose_tokens(logits[3:4], temps[3:4], seeds[3:4]).tolist()
    assert alone[0] == got[3], "a row's draw does not depend on its batch mates"
    draws = {choose_tokens(logits[1:2], temps[1:2], torch.tensor([s], device=device)).item() for s in range(40)}
    assert len(draws) > 5, "seeds differ, draws differ"


@pytest.mark.parametrize("device", [_gpu(d) for d in DEVICES])
def test_sampled_rows_follow_the_distribution_and_skip_masked_tokens(device):
    rows = 1000 if device == "cpu" else 20000
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0])
    logits = torch.log(probs).repeat(rows, 1).to(device)        # the last token masked (-inf)
    temps = torch.ones(rows, device=device)
    seeds = torch.arange(rows, dtype=torch.int64, device=device) * 7919 + 3
    tokens = choose_tokens(logits, temps, seeds).cpu()
    counts = torch.bincount(tokens, minlength=5).float() / rows
    assert counts[4] == 0
    assert torch.allclose(counts, probs, atol=0.05 if device == "cpu" else 0.012), counts
    # temperature 2 on doubled logits: v / t is the same float, so each seed draws the same token (a row's seed
    # alone decides, whatever the batch: the interpreter checks a slice of the rows)
    n = 100 if device == "cpu" else rows
    hot = choose_tokens(logits[:n] * 2, temps[:n] * 2, seeds[:n]).cpu()
    assert torch.equal(hot, tokens[:n])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_greedy_at_the_8b_vocabulary():
    torch.manual_seed(2)
    logits = torch.randn(64, 128256, device="cuda") * 4
    logits[7, 128255] = logits[7, 17] = 1e4
    assert torch.equal(choose_tokens(logits), logits.argmax(-1))
