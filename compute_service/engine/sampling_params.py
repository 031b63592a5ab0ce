"""Per-request sampling parameters, validated before a request enters the batch."""
from __future__ import annotations

import math
from dataclasses import dataclass

from compute_service.engine.errors import InvalidRequestError


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each new token of one request.

    temperature 0 means greedy (top_k/top_p/seed are then irrelevant).
    top_k 0 (or -1) disables top-k; top_p 1.0 disables top-p.
    `seed` makes the request's tokens reproducible regardless of its batch mates.
    Stop strings are matched on the detokenized output text; the token that
    completes one is the last token emitted.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        # Accept lists from callers but store tuples (the value is frozen and hashable).
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        object.__setattr__(self, "stop", tuple(str(s) for s in self.stop))
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        """Raises InvalidRequestError naming the first bad field."""
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidRequestError(
                f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise InvalidRequestError(f"top_k must be an integer >= 1, or 0/-1 to disable it, got {self.top_k!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise InvalidRequestError(f"top_p must be in (0, 1] (1 disables it), got {self.top_p!r}")
        if self.seed is not None and not (0 <= self.seed < 2**63):
            raise InvalidRequestError(f"seed must be in [0, 2**63), got {self.seed!r}")
        if any(t < 0 for t in self.stop_token_ids):
            raise InvalidRequestError(f"stop_token_ids must be non-negative token ids, got {list(self.stop_token_ids)}")
        if any(s == "" for s in self.stop):
            raise InvalidRequestError("stop strings must be non-empty")
