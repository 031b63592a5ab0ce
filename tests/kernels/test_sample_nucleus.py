"""kernels/sample_nucleus.py (the engine's path for rows with top-p alone): a top-p row's token, the race's
winner checked against the nucleus and raced again above it while outside, is the token the threshold path draws
with the same seed (peaked rows, flat ones whose winner often falls outside, small and large p), with greedy and
plain sampled rows beside it unchanged, and a row of -inf alone ending at its first token (the renormalized law:
test_sample_threshold.py, both paths). CPU in Triton's interpreter; GPU at the 8B's vocabulary."""
from __future__ import annotations

import pytest
import torch

from compute_service.engine.sampler import draw_seed, sample_tokens
from compute_service.engine.sampling_params import SamplingParams
from kernels.sample import choose_tokens
from kernels.sample_threshold import candidates_for, row_thresholds

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _gpu(device: str):
    return pytest.param(device, marks=pytest.mark.gpu) if device == "cuda" else device


def _both(logits, temps, seeds, top_p):
    """(threshold path, nucleus path) tokens for rows that all have top-p and no top-k."""
    n, dev = logits.shape[0], logits.device
    thr = row_thresholds(logits, torch.arange(n, device=dev), temps, torch.zeros(n, dtype=torch.int32, device=dev),
                         top_p, candidates_for([0], True, logits.shape[1]))
    return (choose_tokens(logits, temps, seeds, thr).tolist(),
            choose_tokens(logits, temps, seeds, top_p=top_p).tolist())


@pytest.mark.parametrize("device", [_gpu(d) for d in DEVICES])
@pytest.mark.parametrize("scale,p", [(4.0, 0.9), (0.3, 0.3), (0.3, 0.95), (2.0, 0.05)])
def test_same_tokens_as_the_threshold(device, scale, p):
    torch.manual_seed(int(scale * 10 + p * 100))
    rows, vocab = (12, 4096 + 905) if device == "cpu" else (64, 128256)
    logits = (torch.randn(rows, vocab) * scale).to(device)
    dev = logits.device
    temps = torch.full((rows,), 0.8, device=dev)
    seeds = torch.arange(rows, dtype=torch.int64, device=dev) * 104729 + 17
    by_threshold, by_race = _both(logits, temps, seeds, torch.full((rows,), p, device=dev))
    assert by_race == by_threshold


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")       # the interpreter's inf - inf
@pytest.mark.parametrize("device", [_gpu(d) for d in DEVICES])
def test_mixed_rows_and_a_row_of_minus_infinity(device):
    torch.manual_seed(5)
    logits = torch.randn(4, 3000) * 2
    logits[3] = float("-inf")
    logits = logits.to(device)
    dev = logits.device
    temps = torch.tensor([0.0, 1.0, 0.7, 1.0], device=dev)
    seeds = torch.tensor([0, 21, 22, 23], dtype=torch.int64, device=dev)
    top_p = torch.tensor([1.0, 1.0, 0.5, 0.9], device=dev)
    got = choose_tokens(logits, temps, seeds, top_p=top_p).tolist()
    plain = choose_tokens(logits, temps, seeds).tolist()
    assert got[0] == logits[0].argmax().item() and got[1] == plain[1]
    assert got[3] == 0
    thr = row_thresholds(logits, torch.tensor([2], device=dev), temps[2:3], torch.zeros(1, dtype=torch.int32,
                         device=dev), top_p[2:3], 64)
    assert got[2] == choose_tokens(logits, temps, seeds, thr).tolist()[2]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_engine_sampler_draws_what_thresholds_give():
    """The engine's sampler (top-p-alone rows by the race, top-k rows by a threshold) against every filtered row
    drawn under its threshold, greedy and plain rows beside them."""
    torch.manual_seed(6)
    logits = torch.randn(8, 128256, device="cuda") * 4
    params = [SamplingParams(temperature=0.8, top_p=0.9)] * 4 + [SamplingParams(temperature=0.8, top_k=50),
                                                               SamplingParams(temperature=0.8, top_k=40, top_p=0.8),
                                                               SamplingParams(temperature=0.0),
                                                               SamplingParams(temperature=1.0)]
    seeds, indices = list(range(8)), [30] * 8
    got = sample_tokens(logits, params, seeds, indices).tolist()
    dev = logits.device
    temps = torch.tensor([p.temperature for p in params], device=dev)
    row_seeds = torch.tensor([draw_seed(s, i) for s, i in zip(seeds, indices)], dtype=torch.int64, device=dev)
    thr = row_thresholds(logits, torch.arange(6, device=dev), temps[:6],         # rows 6 and 7: no threshold
                         torch.tensor([p.top_k for p in params[:6]], dtype=torch.int32, device=dev),
                         torch.tensor([p.top_p for p in params[:6]], device=dev), 1024)
    assert got == choose_tokens(logits, temps, row_seeds, thr).tolist()
    assert got[6] == logits[6].argmax().item()
