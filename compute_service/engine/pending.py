"""Tokens a step reads before the host has them: with overlapped steps, decode step N+1 is queued while
step N's sampled tokens are still on the device, and its input rows take them there, in stream order."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from compute_service.engine.host_lists import to_device


@dataclass(frozen=True)
class PendingTokens:
    """Input rows to fill on the device: `tokens[sources[i]]` goes to row `rows[i]`."""

    rows: list[int]
    sources: list[int]
    tokens: torch.Tensor            # [N] int64, the step in flight's sampled tokens

    @property
    def in_place(self) -> bool:
        """Row i takes token i for every i: one device copy, no index."""
        return self.rows == self.sources == list(range(len(self.rows)))


def fill_pending(input_ids: torch.Tensor, pending: PendingTokens) -> None:
    """Writes the step in flight's tokens into their rows of `input_ids` (on its device, in stream order:
    after the step that sampled them)."""
    if pending.in_place:
        input_ids[: len(pending.rows)].copy_(pending.tokens[: len(pending.rows)])
        return
    index = to_device([pending.rows, pending.sources], torch.int64, input_ids.device)
    input_ids.index_copy_(0, index[0], pending.tokens.index_select(0, index[1]))
