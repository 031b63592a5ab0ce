"""SamplingParams validation and the per-request sampler."""
from __future__ import annotations

import pytest
import torch

from compute_service.engine.errors import InvalidRequestError
from compute_service.engine.sampler import apply_top_k_top_p, sample_tokens
from compute_service.engine.sampling_params import SamplingParams


def sample(logits, params, generators) -> list[int]:
    """The sampled token ids, read back (the engine reads them when the step lands)."""
    return sample_tokens(logits, params, generators).tolist()


@pytest.mark.parametrize("kwargs, field", [
    (dict(max_tokens=0), "max_tokens"), (dict(temperature=-0.5), "temperature"),
    (dict(temperature=float("nan")), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"), (dict(seed=-1), "seed"), (dict(stop_token_ids=[-3]), "stop_token_ids"),
    (dict(stop=[""]), "stop"),
])
def test_invalid_params_name_the_field(kwargs, field):
    with pytest.raises(InvalidRequestError, match=field):
        SamplingParams(**kwargs)


def gens(seeds):
    return [torch.Generator().manual_seed(s) for s in seeds]


def test_greedy_is_argmax_and_ignores_generators():
    logits = torch.randn(4, 50)
    p = SamplingParams(temperature=0)
    assert sample(logits, [p] * 4, [None] * 4) == logits.argmax(-1).tolist()


def test_top_k_and_top_p_keep_the_right_tokens():
    logits = torch.randn(3, 40)
    masked = apply_top_k_top_p(logits, torch.tensor([3, 0, 0]), torch.tensor([1.0, 1.0, 0.5]))
    assert set(torch.isfinite(masked[0]).nonzero().flatten().tolist()) == set(logits[0].topk(3).indices.tolist())
    assert torch.isfinite(masked[1]).all()
    probs = logits[2].softmax(-1)
    order = probs.argsort(descending=True)
    keep = int((probs[order].cumsum(0) < 0.5).sum()) + 1       # smallest prefix reaching 0.5
    assert set(torch.isfinite(masked[2]).nonzero().flatten().tolist()) == set(order[:keep].tolist())
    assert torch.equal(masked[0][torch.isfinite(masked[0])], logits[0][torch.isfinite(masked[0])])


def test_top_k_draws_only_from_the_top_k():
    logits = torch.randn(1, 30)
    allowed = set(logits[0].topk(4).indices.tolist())
    g = gens([1])
    p = SamplingParams(temperature=1.5, top_k=4)
    draws = {sample(logits, [p], g)[0] for _ in range(200)}
    assert draws <= allowed and len(draws) > 1


def test_seeded_row_is_independent_of_batch_mates():
    torch.manual_seed(0)
    logits = torch.randn(5, 64)
    p = SamplingParams(temperature=0.9, top_p=0.95, seed=7)
    g_alone = gens([7])[0]
    seq_alone = [sample(logits[2:3], [p], [g_alone])[0] for _ in range(20)]
    g_batch = gens([1, 2, 7, 4, 5])
    others = [SamplingParams(temperature=1.0), SamplingParams(temperature=0), p, SamplingParams(top_k=5),
              SamplingParams(temperature=2.0)]
    seq_batch = [sample(logits, others, g_batch)[2] for _ in range(20)]
    assert seq_batch == seq_alone
    assert len(set(seq_alone)) > 1          # it really samples


def test_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]]))
    g = gens([3])
    p = SamplingParams(temperature=1.0)
    counts = torch.bincount(torch.tensor([sample(logits, [p], g)[0] for _ in range(3000)]), minlength=3)
    assert torch.allclose(counts / 3000, torch.tensor([0.7, 0.2, 0.1]), atol=0.03)
