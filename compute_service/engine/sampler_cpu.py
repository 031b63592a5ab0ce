"""The sampler's CPU path: each sampled row's kept tokens (top-k, top-p) and one draw over their softmax.

A row keeps its top-k largest logits, then the smallest prefix of them (largest first) whose mass under
softmax(logits / temperature), renormalized over that set, reaches top-p (the first token always stays). Found
from the rows' largest logits (one `torch.topk` for the batch's filtered rows: `CANDIDATES` a top-p row, or its
top-k) where they hold the nucleus, from one sort of the rows where they do not. The token is an inverse-CDF
draw over the kept tokens' probabilities (summed in float64), its one uniform from a `torch.Generator` seeded
with the row's draw seed (`sampler.draw_seed`): a row's token depends on its request's seed and the token's
position alone.
Until 5ab306d every sampled row drew a uniform per vocabulary token for an exponential race, and rows with
top-k / top-p were masked through a sort of the whole row (`bench/sampler_cost.py --device cpu`,
docs/performance.md).
"""
from __future__ import annotations

import torch

CANDIDATES = 1024       # a top-p row's largest logits looked at before sorting the whole row


def _nucleus_size(vals: torch.Tensor, norm: torch.Tensor, top_p: float) -> int:
    """How many of `vals` (largest first) the smallest prefix reaching top_p takes (softmax normalizer `norm`)."""
    probs = torch.exp(vals - norm)
    return int(((probs.cumsum(0) - probs) < top_p).sum())


def kept_tokens(scaled: torch.Tensor, top_k: list[int], top_p: list[float]) -> list[tuple[torch.Tensor,
                                                                                          torch.Tensor | None]]:
    """scaled [R, V] float32 (logits / temperature) -> per row (its kept values, largest first, and their token
    ids), or (the row, None) where every token stays."""
    rows, vocab = scaled.shape
    ks = [k if 0 < k < vocab else vocab for k in top_k]
    out: list[tuple[torch.Tensor, torch.Tensor | None]] = [(scaled[r], None) for r in range(rows)]
    filtered = [r for r in range(rows) if ks[r] < vocab or top_p[r] < 1.0]
    if not filtered:
        return out
    sub = scaled[filtered]
    want = min(vocab, max(ks[r] if ks[r] < vocab else CANDIDATES for r in filtered))
    cand_vals, cand_ids = sub.topk(want, dim=1)
    norms = torch.logsumexp(sub, 1) if any(ks[r] == vocab for r in filtered) else None
    wide = []
    for a, r in enumerate(filtered):
        vals, ids = cand_vals[a, :ks[r]], cand_ids[a, :ks[r]]
        if top_p[r] < 1.0:
            norm = torch.logsumexp(vals, 0) if ks[r] < vocab else norms[a]
            kept = _nucleus_size(vals, norm, top_p[r])
            if kept == len(vals) < ks[r]:           # the nucleus may go on past the candidates
                wide.append(a)
                continue
            vals, ids = vals[:max(kept, 1)], ids[:max(kept, 1)]
        out[r] = (vals, ids)
    if wide:
        sorted_vals, sorted_ids = sub[wide].sort(dim=1, descending=True)
        for b, a in enumerate(wide):
            kept = max(_nucleus_size(sorted_vals[b], norms[a], top_p[filtered[a]]), 1)
            out[filtered[a]] = (sorted_vals[b, :kept], sorted_ids[b, :kept])
    return out


def _uniform(seed: int) -> float:
    return float(torch.rand((), dtype=torch.float64, generator=torch.Generator().manual_seed(seed)))


def draw(logits: torch.Tensor, temps: list[float], top_k: list[int], top_p: list[float],
         seeds: list[int]) -> list[int]:
    """logits [R, V] of sampled rows -> each row's token (`seeds`: the rows' draw seeds). A row whose weights are
    not finite (a NaN or +inf logit, or none above -inf) gives its argmax."""
    scaled = logits.float() / torch.tensor(temps, dtype=torch.float32)[:, None]
    tokens = []
    for r, (vals, ids) in enumerate(kept_tokens(scaled, top_k, top_p)):
        cdf = torch.exp(vals - vals.max()).double().cumsum(0)    # a row at a time: faster than the batch's (2D)
        total = float(cdf[-1])
        if not 0.0 < total < float("inf"):
            tokens.append(int(logits[r].argmax()))
            continue
        at = int(torch.searchsorted(cdf, torch.tensor([_uniform(seeds[r]) * total], dtype=torch.float64),
                                    right=True))
        at = min(at, len(cdf) - 1)
        tokens.append(at if ids is None else int(ids[at]))
    return tokens
