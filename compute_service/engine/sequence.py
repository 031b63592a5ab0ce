"""One request's state inside the engine (plain Python, no torch)."""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from compute_service.engine.sampling_params import SamplingParams


class SequenceStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, Enum):
    """Why a request stopped: a stop condition, a length limit, or a cancel."""

    STOP = "stop"        # EOS, a stop token id or a stop string
    LENGTH = "length"    # max_tokens or max_model_len reached
    ABORT = "abort"      # cancelled by the caller


@dataclass(eq=False)
class Sequence:
    """Token ids (prompt then output) and how many of them are in the KV cache.

    Invariant between steps: `num_computed_tokens <= num_tokens`; a running
    sequence in decode has exactly one token (the last sampled) not computed,
    which with overlapped steps may still be on the device (`num_pending`).
    """

    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    adapter_key: str | None
    arrival: int                                   # admission order key; smaller = older
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    num_emitted_tokens: int = 0                    # output tokens already reported to the caller
    num_preemptions: int = 0
    pinned: bool = False                           # holds a pin on its adapter
    # Tokens sampled by a step still on the device (overlapped steps): counted in `num_tokens`, not yet in
    # `token_ids`; the engine appends each once the step lands.
    num_pending: int = 0
    # Where the caller routes this sequence's tokens (opaque to the engine). With one, a step's plain
    # one-token deltas are not made into `RequestOutput`s: the sequence goes to `LLMEngine.routed`.
    route: Any = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids) + self.num_pending

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) + self.num_pending - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
