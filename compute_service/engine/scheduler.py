"""Continuous batching: which sequences run this step, and with how many tokens.

Plain Python (no torch), so it is unit-tested on its own. Each step:
1. running sequences, oldest first, get their next chunk (1 token in decode, up
   to the token budget in prefill); when KV blocks run out the newest running
   sequence is preempted (blocks freed, progress dropped, put back at the head
   of the queue) and recomputed later from its prompt and the tokens it has
   already produced, so nothing is dropped;
2. if nothing was preempted, waiting sequences whose adapter is ready are
   admitted, oldest first, while token, sequence and block budgets allow; an
   adapter that is still loading keeps only its own requests waiting.
Long prompts are prefilled in chunks, so decodes keep running beside them.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Protocol

from compute_service.engine.block_manager import BlockManager
from compute_service.engine.sequence import FinishReason, Sequence, SequenceStatus


class AdapterGate(Protocol):
    """What the scheduler needs from the adapter slots."""

    def is_ready(self, key: str) -> bool: ...
    def pin(self, key: str) -> None: ...
    def unpin(self, key: str) -> None: ...


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1 or self.max_model_len < 2:
            raise ValueError(f"scheduler limits must be positive (max_model_len >= 2): {self}")


@dataclass(slots=True)
class ScheduledSeq:
    """`seq` runs tokens [start, start + num_new_tokens); `sample` when that reaches its end.

    Not frozen: one is made per sequence per step, and a frozen dataclass's constructor costs about 4x
    (each field set through object.__setattr__)."""

    seq: Sequence
    start: int
    num_new_tokens: int
    sample: bool


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


def _arrival(seq: Sequence) -> int:
    return seq.arrival


class Scheduler:
    """Owns the waiting and running queues and the block manager."""

    def __init__(self, config: SchedulerConfig, blocks: BlockManager, adapters: AdapterGate | None = None) -> None:
        self.config = config
        self.blocks = blocks
        self.adapters = adapters
        self.waiting: list[Sequence] = []   # sorted by arrival
        self.running: list[Sequence] = []   # sorted by arrival
        self._by_id: dict[str, Sequence] = {}

    # -- queue changes -------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        if seq.request_id in self._by_id:
            raise ValueError(f"request id {seq.request_id!r} is already in the engine")
        if seq.adapter_key is not None and self.adapters is None:
            raise ValueError("this scheduler has no adapter slots; requests cannot name an adapter")
        seq.status = SequenceStatus.WAITING
        bisect.insort(self.waiting, seq, key=_arrival)
        self._by_id[seq.request_id] = seq

    def get(self, request_id: str) -> Sequence | None:
        return self._by_id.get(request_id)

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Ends `seq`: frees its blocks, drops its adapter pin, forgets it."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self._release(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.num_pending = 0      # a token of a step in flight is dropped when that step lands
        self._by_id.pop(seq.request_id, None)

    def abort(self, request_id: str) -> Sequence | None:
        seq = self._by_id.get(request_id)
        if seq is not None:
            self.finish(seq, FinishReason.ABORT)
        return seq

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step --------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        i = 0
        running, try_grow = self.running, self.blocks.try_grow
        while i < len(running) and budget > 0:
            seq = running[i]
            n = min(seq.num_uncomputed_tokens, budget)
            end = seq.num_computed_tokens + n
            while not try_grow(seq, end):
                victim = running[-1]
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                break
            out.scheduled.append(ScheduledSeq(seq, seq.num_computed_tokens, n, n == seq.num_uncomputed_tokens))
            budget -= n
            i += 1
        if not out.preempted:
            self._admit(out, budget)
        return out

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        j = 0
        while j < len(self.waiting) and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[j]
            if seq.adapter_key is not None and not self.adapters.is_ready(seq.adapter_key):  # type: ignore[union-attr]
                j += 1          # its adapter is loading: let the ones behind it go first
                continue
            n = min(seq.num_uncomputed_tokens, budget)
            end = seq.num_computed_tokens + n
            if not self.blocks.try_grow(seq, end):
                break           # oldest first: do not let younger ones overtake on blocks
            self.waiting.pop(j)
            if seq.adapter_key is not None:
                self.adapters.pin(seq.adapter_key)  # type: ignore[union-attr]
                seq.pinned = True
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self.running, seq, key=_arrival)
            out.scheduled.append(ScheduledSeq(seq, seq.num_computed_tokens, n, n == seq.num_uncomputed_tokens))
            budget -= n

    def _preempt(self, seq: Sequence) -> None:
        """Drops `seq`'s KV cache and queues it for recompute (prompt + its outputs)."""
        self.running.remove(seq)
        self._release(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        bisect.insort(self.waiting, seq, key=_arrival)

    def _release(self, seq: Sequence) -> None:
        self.blocks.free(seq)
        if seq.pinned:
            self.adapters.unpin(seq.adapter_key)  # type: ignore[union-attr, arg-type]
            seq.pinned = False

    def schedule_decode(self) -> SchedulerOutput | None:
        """The next decode step while the previous one is still on the device (overlapped steps): one row
        per running sequence, each of whose newest token is pending. Sequences that reach their length
        limit with the pending token are left out (they finish when it lands); a sequence that stops on
        EOS or a stop string gets a row whose token is dropped. None when this step needs what only the
        full `schedule` does (a request to admit, a preemption, a chunk of prefill): land first."""
        cfg = self.config
        running = self.running
        if len(running) > cfg.max_num_batched_tokens:
            return None
        if len(running) < cfg.max_num_seqs and any(
                seq.adapter_key is None or self.adapters.is_ready(seq.adapter_key)  # type: ignore[union-attr]
                for seq in self.waiting):
            return None
        out = SchedulerOutput()
        try_grow = self.blocks.try_grow
        for seq in running:
            total = len(seq.token_ids) + seq.num_pending
            if seq.num_pending and (total - seq.num_prompt_tokens >= seq.params.max_tokens
                                    or total >= cfg.max_model_len):
                continue
            if total - seq.num_computed_tokens != 1 or not try_grow(seq, total):
                return None
            out.scheduled.append(ScheduledSeq(seq, seq.num_computed_tokens, 1, True))
        return out

    # -- after the model ran ---------------------------------------------------
    def advance(self, out: SchedulerOutput) -> list[Sequence]:
        """The step is launched: computed counts move on, and each sampling sequence has one more token
        pending. Returns the sampling sequences, in schedule order."""
        sampling = []
        for s in out.scheduled:
            s.seq.num_computed_tokens = s.start + s.num_new_tokens
            if s.sample:
                s.seq.num_pending += 1
                sampling.append(s.seq)
        return sampling

    @staticmethod
    def land(sampling: list[Sequence], tokens: list[int]) -> list[Sequence]:
        """A launched step's tokens are read back: each appended to its sequence, unless the sequence
        finished meanwhile (aborted, or stopped on its previous token). Returns the sequences that grew."""
        grown = []
        for seq, token in zip(sampling, tokens):
            if seq.status is SequenceStatus.FINISHED:
                continue
            seq.token_ids.append(token)
            seq.num_pending -= 1
            grown.append(seq)
        return grown

    def update(self, out: SchedulerOutput, sampled: dict[str, int]) -> list[Sequence]:
        """Advances computed counts and appends sampled tokens; returns sequences that grew."""
        sampling = self.advance(out)
        return self.land(sampling, [sampled[seq.request_id] for seq in sampling])
