"""kernels/sample_threshold.py: a row's top-k / top-p threshold keeps exactly the tokens a float64 sort keeps
(nucleus inside the candidates, wider than them, top-k above them, both at once), every tied token at the
threshold, and `choose_tokens` draws only above it, with the renormalized probabilities. CPU in Triton's
interpreter (small candidate counts, so the exact bisection runs); GPU at the 8B's vocabulary."""
from __future__ import annotations

import pytest
import torch

from kernels.sample import choose_tokens
from kernels.sample_threshold import BLOCK, NONE, candidates_for, row_thresholds

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _gpu(device: str):
    return pytest.param(device, marks=pytest.mark.gpu) if device == "cuda" else device


def _order_key(v: torch.Tensor) -> torch.Tensor:
    bits = torch.where(v == 0, torch.zeros_like(v), v).float().view(torch.int32)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


def _kept_reference(row: torch.Tensor, temp: float, top_k: int, top_p: float) -> set[int]:
    """The tokens a float64 sort keeps (top-k first, then the smallest prefix whose renormalized mass reaches p)."""
    vals, order = (row.double() / temp).sort(descending=True)
    n = len(vals) if top_k <= 0 else min(top_k, len(vals))
    probs = torch.softmax(vals[:n], 0)
    before = probs.cumsum(0) - probs
    m = int((before < top_p).sum())
    return set(order[:m].tolist())


def _p_between(row: torch.Tensor, temp: float, top_k: int, m: int) -> float:
    """A top-p whose nucleus is the m largest tokens with a clear margin on both sides (no rounding case)."""
    vals = (row.double() / temp).sort(descending=True).values
    n = len(vals) if top_k <= 0 else min(top_k, len(vals))
    cum = torch.softmax(vals[:n], 0).cumsum(0)
    return float((cum[m - 2] + cum[m - 1]) / 2) if m > 1 else float(cum[0] / 2)


def _kept(row: torch.Tensor, thr: int) -> set[int]:
    return set(torch.nonzero(_order_key(row.cpu()) >= thr).flatten().tolist())


def _thresholds(logits, rows, temps, top_k, top_p, cands):
    dev = logits.device
    return row_thresholds(logits, torch.tensor(rows, dtype=torch.int64, device=dev),
                          torch.tensor(temps, dtype=torch.float32, device=dev),
                          torch.tensor(top_k, dtype=torch.int32, device=dev),
                          torch.tensor(top_p, dtype=torch.float32, device=dev), cands).cpu()


# (temperature, top_k, m: the nucleus size top_p is set for, or 0 = no top-p); cands 16 in every case
CASES = [
    (1.0, 0, 5),          # the nucleus inside the candidates
    (0.7, 0, 40),         # wider than the candidates: bisection over the row
    (1.3, 10, 0),         # top-k inside the candidates
    (1.0, 100, 0),        # top-k above them: counted by bisection
    (0.9, 12, 4),         # both, inside
    (1.0, 60, 30),        # both, top-k and the nucleus wider than the candidates
    (1.0, 0, 1),          # top-p keeping the top token alone
]


@pytest.mark.parametrize("device", [_gpu(d) for d in DEVICES])
def test_thresholds_keep_what_a_sort_keeps(device):
    torch.manual_seed(0)
    vocab = BLOCK + 733                                          # two blocks a pass, the second partial
    logits = (torch.randn(len(CASES) + 1, vocab) * 2).to(device)
    rows, temps, top_k, top_p = [], [], [], []
    for r, (t, k, m) in enumerate(CASES):
        rows.append(r)
        temps.append(t)
        top_k.append(k)
        top_p.append(_p_between(logits[r].cpu(), t, k, m) if m else 1.0)
    thr = _thresholds(logits, rows, temps, top_k, top_p, 16)
    assert thr[len(CASES)] == NONE, "a row not listed keeps every token"
    for r, (t, k, m) in enumerate(CASES):
        want = _kept_reference(logits[r].cpu(), t, k, top_p[r])
        assert _kept(logits[r], int(thr[r])) == want, (r, t, k, m, len(want))


@pytest.mark.parametrize("device", [_gpu(d) for d in DEVICES])
def test_ties_at_the_threshold_are_all_kept(device):
    row = torch.full((3000,), -5.0)
    row[:3] = torch.tensor([4.0, 3.0, 2.0])
    row[100:110] = 2.0                                           # 11 tokens tie at the third value
    logits = row[None].to(device)
    thr = _thresholds(logits, [0], [1.0], [3], [1.0], 8)         # top-3, the tie beyond the candidates
    assert _kept(logits[0], int(thr[0])) == {0, 1, 2, *range(100, 110)}
    for cands in (8, 16):     # a sort keeps ~9 of the 2.0s for p 0.8 (each 0.042 of the mass, 0.42 before them)
        thr = _thresholds(logits, [0], [1.0], [0], [0.8], cands)
        assert _kept(logits[0], int(thr[0])) == {0, 1, 2, *range(100, 110)}, cands


@pytest.mark.parametrize("device", [_gpu(d) for d in DEVICES])
def test_top_k_at_or_above_the_vocabulary_keeps_everything(device):
    logits = torch.randn(2, 300).to(device)
    thr = _thresholds(logits, [0, 1], [1.0, 1.0], [300, 5000], [1.0, 1.0], 64)
    assert thr.tolist() == [NONE, NONE]


@pytest.mark.parametrize("device", [_gpu(d) for d in DEVICES])
def test_draws_stay_above_the_threshold_with_renormalized_probabilities(device):
    rows = 600 if device == "cpu" else 20000
    probs = torch.tensor([0.4, 0.3, 0.2, 0.06, 0.04])
    logits = torch.log(probs).repeat(rows, 1).to(device)
    dev = logits.device
    # top-p 0.85: the first three (mass before the third 0.7 < 0.85, before the fourth 0.9)
    top_p = torch.full((rows,), 0.85, device=dev)
    seeds = torch.arange(rows, dtype=torch.int64, device=dev) * 7919 + 5
    ones = torch.ones(rows, device=dev)
    thr = row_thresholds(logits, torch.arange(rows, device=dev), ones, torch.zeros(rows, dtype=torch.int32, device=dev),
                         top_p, 4)
    tokens = choose_tokens(logits, ones, seeds, thr).cpu()
    counts = torch.bincount(tokens, minlength=5).float() / rows
    assert counts[3] == 0 and counts[4] == 0
    want = torch.tensor([0.4, 0.3, 0.2, 0, 0]) / 0.9
    assert torch.allclose(counts, want, atol=0.06 if device == "cpu" else 0.012), counts
    # top-p alone races without a threshold (kernels/sample_nucleus.py): the token a threshold at the nucleus's
    # boundary gives, seed for seed (the interpreter checks a slice of the rows)
    n = 150 if device == "cpu" else rows
    raced = choose_tokens(logits[:n], ones[:n], seeds[:n], top_p=top_p[:n]).cpu()
    assert torch.equal(raced, tokens[:n])


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")       # the interpreter's inf - inf
@pytest.mark.parametrize("device", [_gpu(d) for d in DEVICES])
def test_an_infinite_logit_is_the_token_drawn(device):
    logits = torch.randn(2, 500)
    logits[0, 37] = float("inf")                                 # its softmax is NaN: the top token stays
    logits[1] = float("-inf")                                    # nothing finite: token 0, as argmax
    logits = logits.to(device)
    dev = logits.device
    thr = row_thresholds(logits, torch.arange(2, device=dev), torch.ones(2, device=dev),
                         torch.zeros(2, dtype=torch.int32, device=dev), torch.full((2,), 0.9, device=dev), 64)
    tokens = choose_tokens(logits, torch.ones(2, device=dev), torch.tensor([3, 4], device=dev), thr)
    assert tokens.tolist() == [37, 0]


def test_wrong_dtypes_and_shapes_are_refused():
    logits = torch.randn(2, 100)
    ok = dict(rows=torch.tensor([0, 1]), temps=torch.ones(2), top_k=torch.zeros(2, dtype=torch.int32),
              top_p=torch.full((2,), 0.9), cands=64)
    with pytest.raises(TypeError):
        row_thresholds(logits, **{**ok, "top_k": torch.zeros(2, dtype=torch.int64)})
    with pytest.raises(ValueError):
        row_thresholds(logits, **{**ok, "top_p": torch.full((3,), 0.9)})


def test_candidate_counts():
    assert candidates_for([50], False, 128256) == 64
    assert candidates_for([0, 200], False, 128256) == 1024
    assert candidates_for([0], True, 128256) == 1024
    assert candidates_for([50], True, 500) == 500


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_thresholds_at_the_8b_vocabulary():
    torch.manual_seed(3)
    vocab = 128256
    logits = torch.randn(6, vocab, device="cuda") * 3
    logits[1] *= 0.2                                             # a flat row: its nucleus wider than 1024
    specs = [(0.8, 0, 20), (1.0, 0, 3000), (0.8, 50, 0), (0.6, 2000, 0), (1.0, 40, 12), (0.8, 0, 1)]
    top_p = [_p_between(logits[r].cpu(), t, k, m) if m else 1.0 for r, (t, k, m) in enumerate(specs)]
    thr = _thresholds(logits, list(range(6)), [s[0] for s in specs], [s[1] for s in specs], top_p,
                      candidates_for([s[1] for s in specs], True, vocab))
    for r, (t, k, m) in enumerate(specs):
        assert _kept(logits[r], int(thr[r])) == _kept_reference(logits[r].cpu(), t, k, top_p[r]), (r, t, k, m)
