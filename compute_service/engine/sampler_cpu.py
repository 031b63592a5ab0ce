"""The sampler's CPU path: a sampled row's kept tokens (top-k, top-p) and one draw over their softmax.

A row keeps its top-k largest logits, then the smallest prefix of them (largest first) whose mass under
softmax(logits / temperature), renormalized over that set, reaches top-p (the first token always stays). Found
from the row's `CANDIDATES` largest (`torch.topk`, a partial selection) where they hold the nucleus, from a sort
of the row where they do not. The token is an inverse-CDF draw over the kept tokens' probabilities (summed in
float64), its one uniform from a `torch.Generator` seeded with the row's draw seed (`sampler.draw_seed`): a row's
token depends on its request's seed and the token's position alone. Before, every sampled row drew a uniform per
vocabulary token for an exponential race and rows with top-k / top-p were masked through a sort of the whole row
(`bench/sampler_cost.py --device cpu`, docs/performance.md).
"""
from __future__ import annotations

import torch

CANDIDATES = 1024       # a top-p row's largest logits looked at before sorting the whole row


def kept_tokens(scaled: torch.Tensor, top_k: int, top_p: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """scaled [V] float32 (logits / temperature) -> (their kept values, largest first, and those values' token
    ids), or (scaled, None) where every token stays."""
    vocab = scaled.numel()
    k = top_k if 0 < top_k < vocab else vocab
    if k == vocab and top_p >= 1.0:
        return scaled, None
    vals, ids = scaled.topk(k if k < vocab else min(CANDIDATES, vocab))
    if top_p >= 1.0:
        return vals, ids
    norm = torch.logsumexp(vals if k < vocab else scaled, 0)
    probs = torch.exp(vals - norm)
    kept = int(((probs.cumsum(0) - probs) < top_p).sum())
    if kept == len(vals) and len(vals) < k:         # the nucleus may go on past the candidates
        vals, ids = scaled.sort(descending=True)
        probs = torch.exp(vals - norm)
        kept = int(((probs.cumsum(0) - probs) < top_p).sum())
    kept = max(kept, 1)
    return vals[:kept], ids[:kept]


def draw(row: torch.Tensor, temperature: float, top_k: int, top_p: float, seed: int) -> int:
    """One sampled row's token: row [V] logits, `seed` the row's draw seed."""
    vals, ids = kept_tokens(row.float() / temperature, top_k, top_p)
    cdf = torch.exp(vals - vals.max()).double().cumsum(0)      # float32 weights, summed in float64
    total = float(cdf[-1])
    if not total > 0.0 or total == float("inf"):    # NaN or infinite logits, or none finite: the row's argmax
        return int(row.argmax())
    u = float(torch.rand((), dtype=torch.float64, generator=torch.Generator().manual_seed(seed)))
    at = min(int(torch.searchsorted(cdf, torch.tensor([u * total], dtype=torch.float64), right=True)), len(cdf) - 1)
    return at if ids is None else int(ids[at])
