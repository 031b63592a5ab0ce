"""SamplingParams validation and the per-request sampler."""
from __future__ import annotations

import pytest
import torch

from compute_service.engine.errors import InvalidRequestError
from compute_service.engine.sampler import draw_seed, sample_tokens
from compute_service.engine.sampler_cpu import CANDIDATES, kept_tokens
from compute_service.engine.sampling_params import SamplingParams


def sample(logits, params, seeds, indices=None) -> list[int]:
    """The sampled token ids, read back (the engine reads them when the step lands)."""
    return sample_tokens(logits, params, seeds, indices if indices is not None else [0] * len(params)).tolist()


@pytest.mark.parametrize("kwargs, field", [
    (dict(max_tokens=0), "max_tokens"), (dict(temperature=-0.5), "temperature"),
    (dict(temperature=float("nan")), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"), (dict(seed=-1), "seed"), (dict(stop_token_ids=[-3]), "stop_token_ids"),
    (dict(stop=[""]), "stop"),
])
def test_invalid_params_name_the_field(kwargs, field):
    with pytest.raises(InvalidRequestError, match=field):
        SamplingParams(**kwargs)


def test_greedy_is_argmax_and_ignores_seeds():
    logits = torch.randn(4, 50)
    logits[1, 7] = logits[1, 30] = logits[1].max() + 1      # a tie: the first index, as argmax
    p = SamplingParams(temperature=0)
    assert sample(logits, [p] * 4, [1, 2, 3, 4]) == logits.argmax(-1).tolist()


def _nucleus(scaled: torch.Tensor, top_k: int, top_p: float) -> set[int]:
    """The float64 sort's kept set: top-k, then the smallest prefix whose renormalized mass reaches top_p."""
    vals, order = scaled.double().sort(descending=True)
    n = top_k if top_k > 0 else len(vals)
    probs = vals[:n].softmax(0)
    return set(order[:int(((probs.cumsum(0) - probs) < top_p).sum())].tolist())


@pytest.mark.parametrize("scale, top_k, top_p", [
    (3.0, 3, 1.0), (3.0, 0, 0.5), (3.0, 10, 0.6), (0.2, 0, 0.9),      # 0.2: a nucleus wider than the candidates
    (0.2, 2000, 0.7), (3.0, 0, 1e-6),                                 # top-k above the candidates; the top alone
])
def test_kept_tokens_are_the_sorts(scale, top_k, top_p):
    torch.manual_seed(int(scale * 10) + top_k)
    scaled = torch.randn(3, 5000) * scale
    scaled[1] *= 8                                                    # a peaked row beside it
    kept = kept_tokens(scaled, [top_k, top_k, 0], [top_p, top_p, 1.0])
    for r in range(2):
        vals, ids = kept[r]
        assert set(ids.tolist()) == _nucleus(scaled[r], top_k, top_p), r
        assert torch.equal(vals, scaled[r][ids]) and bool((vals[:-1] >= vals[1:]).all())
    assert kept[2][1] is None
    if scale < 1 and top_k == 0:
        assert len(kept[0][1]) > CANDIDATES


def test_no_top_k_or_top_p_keeps_every_token():
    scaled = torch.randn(3, 100)
    kept = kept_tokens(scaled, [0, 100, -1], [1.0, 1.0, 1.0])
    assert all(ids is None and torch.equal(vals, scaled[r]) for r, (vals, ids) in enumerate(kept))


def test_top_p_draws_follow_the_renormalized_law():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.06, 0.04]]))
    p = SamplingParams(temperature=1.0, top_p=0.85)                  # the first three (0.9 of the mass)
    counts = torch.bincount(torch.tensor([sample(logits, [p], [5], [i])[0] for i in range(3000)]), minlength=5)
    assert counts[3] == 0 and counts[4] == 0
    assert torch.allclose(counts / 3000, torch.tensor([0.4, 0.3, 0.2, 0, 0]) / 0.9, atol=0.03)


def test_infinite_and_nan_rows_give_their_argmax():
    logits = torch.randn(2, 20)
    logits[0, 4] = float("inf")
    logits[1] = float("-inf")
    p = SamplingParams(temperature=0.7, top_p=0.9)
    assert sample(logits, [p, p], [1, 2]) == [4, 0]


def test_top_k_draws_only_from_the_top_k_and_leaves_the_logits():
    logits = torch.randn(1, 30)
    before = logits.clone()
    allowed = set(logits[0].topk(4).indices.tolist())
    p = SamplingParams(temperature=1.5, top_k=4)
    draws = {sample(logits, [p], [1], [i])[0] for i in range(200)}
    assert draws <= allowed and len(draws) > 1
    assert torch.equal(logits, before), "callers keep the step's logits: masks go to a copy"


def test_a_draw_depends_on_its_seed_and_index_alone():
    torch.manual_seed(0)
    logits = torch.randn(5, 64)
    p = SamplingParams(temperature=0.9, top_p=0.95, seed=7)
    alone = [sample(logits[2:3], [p], [7], [i])[0] for i in range(20)]
    others = [SamplingParams(temperature=1.0), SamplingParams(temperature=0), p, SamplingParams(top_k=5),
              SamplingParams(temperature=2.0)]
    batch = [sample(logits, others, [1, 2, 7, 4, 5], [i + 3, 0, i, 9, i])[2] for i in range(20)]
    assert batch == alone
    assert len(set(alone)) > 1          # it really samples
    assert [sample(logits[2:3], [p], [8], [i])[0] for i in range(20)] != alone      # another seed, other draws


def test_draw_seeds_mix_seed_and_index():
    seeds = {draw_seed(s, i) for s in range(50) for i in range(50)}
    assert len(seeds) == 2500 and all(0 <= v < 2**63 for v in seeds)
    assert draw_seed(5, 3) == draw_seed(5, 3)


def test_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]]))
    p = SamplingParams(temperature=1.0)
    counts = torch.bincount(torch.tensor([sample(logits, [p], [3], [i])[0] for i in range(3000)]), minlength=3)
    assert torch.allclose(counts / 3000, torch.tensor([0.7, 0.2, 0.1]), atol=0.03)
