"""When a request is done after its newest token (plain Python)."""
from __future__ import annotations

from typing import Callable

from compute_service.engine.sequence import FinishReason, Sequence

Detokenize = Callable[[list[int]], str]


def check_stop(seq: Sequence, eos_token_ids: tuple[int, ...], max_model_len: int,
               detokenize: Detokenize | None) -> FinishReason | None:
    """Stop ids and EOS first, then stop strings on the decoded output, then length limits."""
    p = seq.params
    tokens = seq.token_ids
    last = tokens[-1]
    if last in p.stop_token_ids or (not p.ignore_eos and last in eos_token_ids):
        return FinishReason.STOP
    if p.stop and detokenize is not None:
        # A stop string may straddle tokens, so look at the decoded tail that could hold it.
        window = max(len(s) for s in p.stop) + 8
        text = detokenize(seq.output_token_ids[-window:])
        if any(s in text for s in p.stop):
            return FinishReason.STOP
    if len(tokens) - seq.num_prompt_tokens >= p.max_tokens or len(tokens) >= max_model_len:
        return FinishReason.LENGTH
    return None
