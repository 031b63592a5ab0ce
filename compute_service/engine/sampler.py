"""Per-request token sampling: greedy, temperature, top-k, top-p, each row's draw from its own seed.

A sampled row's noise comes only from its request's seed and the index of the token it draws (`draw_seed`): a
seeded request gives the same tokens whatever else is in the batch, in whatever step its tokens come, and
after a preemption (recompute does not sample again). A batch of greedy rows alone is the library's argmax. With
a sampled row, on a GPU, every row is chosen by `kernels.sample` (two launches for the whole batch: greedy rows
an argmax, sampled ones an exponential race on counter-based noise). Rows with top-k draw only above a threshold
per row (`kernels.sample_threshold`: a top-k of candidates and one pass over the row, no sort of the vocabulary;
every token tied with the threshold is kept). Rows with top-p alone keep the race's winner where it lies inside
the nucleus and race again above it where not (`kernels.sample_nucleus`: the token a threshold would give,
without the candidates' `torch.topk`; H200, GPU µs at batch 1 / 8 / 64 against the threshold: 121 / 130 / 270
-> 29 / 142 / 198, a flat row's wide nucleus 362 / 374 / 522 -> 29 / 142 / 198; bench/results/sampler_cost.json).
On the CPU a row keeps the same tokens (ties at the boundary: some of them) and draws one by inverse CDF with a
`torch.Generator` seeded with the row's draw seed (`sampler_cpu`): seeded CPU and GPU runs give different
tokens, each repeatable.
"""
from __future__ import annotations

import torch

from compute_service.engine.host_lists import to_device
from compute_service.engine.sampler_cpu import draw
from compute_service.engine.sampling_params import SamplingParams

_MASK64 = (1 << 64) - 1


def draw_seed(seed: int, index: int) -> int:
    """The 63-bit seed of a request's draw of its token at `index` (the token's position in the sequence): the
    request's seed and the index mixed (splitmix64's finalizer), so neighbouring seeds or indices give unrelated
    noise."""
    z = (seed * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


def sample_tokens(logits: torch.Tensor, params: list[SamplingParams], seeds: list[int],
                  indices: list[int]) -> torch.Tensor:
    """logits [N, V] float32 -> token ids [N] int64 on the logits' device, without waiting for it. Row i draws
    with its request's `seeds[i]` the token at `indices[i]` (its position in the sequence)."""
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    if not sampled:
        # Greedy rows alone: the library's argmax, one launch: 42-52 µs from launch to tokens at the 8B's vocabulary
        # (GPU 29-41) against 77-113 for the two Triton launches, bound by their host work (H200, batch 1-64,
        # bench/results/sampler_cost_4ba8ef3.json)
        return logits.argmax(dim=-1)
    temps = [0.0 if p.greedy else p.temperature for p in params]
    row_seeds = [0] * len(params)
    for i in sampled:
        row_seeds[i] = draw_seed(seeds[i], indices[i])
    if logits.is_cuda:
        from kernels.sample import choose_tokens
        from kernels.sample_threshold import candidates_for, row_thresholds

        dev, thresholds, nucleus = logits.device, None, None
        top_p_alone = [i for i in sampled if params[i].top_k <= 0 and params[i].top_p < 1.0]
        if top_p_alone:                            # the race's winner checked against the nucleus
            nucleus = [1.0] * len(params)
            for i in top_p_alone:
                nucleus[i] = params[i].top_p
        with_top_k = [i for i in sampled if params[i].top_k > 0]
        if with_top_k:                             # each such row's threshold key: no sort of the vocabulary
            top_ks = [params[i].top_k for i in with_top_k]
            top_ps = [params[i].top_p for i in with_top_k]
            cands = candidates_for(top_ks, min(top_ps) < 1.0, logits.shape[-1])
            thresholds = row_thresholds(logits, to_device(with_top_k, torch.int64, dev),
                                        to_device([temps[i] for i in with_top_k], torch.float32, dev),
                                        to_device(top_ks, torch.int32, dev), to_device(top_ps, torch.float32, dev),
                                        cands)
        return choose_tokens(logits, to_device(temps, torch.float32, dev), to_device(row_seeds, torch.int64, dev),
                             thresholds, None if nucleus is None else to_device(nucleus, torch.float32, dev))
    tokens = logits.argmax(dim=-1)
    drawn = draw(logits[sampled], [temps[i] for i in sampled], [params[i].top_k for i in sampled],
                 [params[i].top_p for i in sampled], [row_seeds[i] for i in sampled])
    tokens[sampled] = torch.tensor(drawn, dtype=tokens.dtype)
    return tokens
