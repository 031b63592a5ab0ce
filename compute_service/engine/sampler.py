"""Per-request token sampling: greedy, temperature, top-k, top-p, each row with its own generator.

A row's random draw comes only from its request's generator, so a seeded
request gives the same tokens whatever else is in the batch, and after a
preemption (recompute does not sample again).
"""
from __future__ import annotations

import torch

from compute_service.engine.host_lists import to_device
from compute_service.engine.sampling_params import SamplingParams


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """logits [N, V] float32, top_k [N] int64 (0 = off), top_p [N] float32 -> masked logits (-inf)."""
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device)
    k = torch.where(top_k > 0, top_k, vocab)
    sorted_logits = sorted_logits.masked_fill(ranks[None, :] >= k[:, None], float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
    outside = (probs.cumsum(dim=-1) - probs) >= top_p[:, None]
    sorted_logits = sorted_logits.masked_fill(outside, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


def sample_tokens(logits: torch.Tensor, params: list[SamplingParams],
                  generators: list[torch.Generator | None]) -> torch.Tensor:
    """logits [N, V] float32 -> token ids [N] int64 on the logits' device, without waiting for it."""
    tokens = logits.argmax(dim=-1)                                  # greedy for every row first
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        dev = logits.device
        idx = to_device(rows, torch.int64, dev)
        temps = to_device([params[i].temperature for i in rows], torch.float32, dev)
        top_k = to_device([max(params[i].top_k, 0) for i in rows], torch.int64, dev)
        top_p = to_device([params[i].top_p for i in rows], torch.float32, dev)
        scaled = apply_top_k_top_p(logits[idx] / temps[:, None], top_k, top_p)
        probs = scaled.softmax(dim=-1)
        # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p; E comes from the row's own generator.
        noise = torch.stack([torch.empty_like(probs[0]).exponential_(generator=generators[i]) for i in rows])
        tokens[idx] = (probs / noise).argmax(dim=-1)
    return tokens
