"""What the engine reports: per-step deltas per request and engine-wide stats."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class RequestOutput:
    """New tokens of one request since the last step; `finished` on its last delta. Read-only by
    convention: one is made per request per step, and a frozen dataclass's constructor costs about 4x."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None          # "stop" | "length" | "abort" when finished
    num_prompt_tokens: int
    num_output_tokens: int


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_kv_blocks_used: int
    num_kv_blocks_total: int
    num_preemptions: int
    running_per_adapter: dict[str, int] = field(default_factory=dict)   # adapter key ("" = base) -> count
    waiting_per_adapter: dict[str, int] = field(default_factory=dict)
