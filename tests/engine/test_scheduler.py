"""Scheduler and block manager, plain Python: chunked prefill, preemption/recompute, cancellation, adapter gating."""
from __future__ import annotations

import random
import subprocess
import sys
from collections import Counter

from compute_service.engine.block_manager import BlockManager
from compute_service.engine.sampling_params import SamplingParams
from compute_service.engine.scheduler import Scheduler, SchedulerConfig
from compute_service.engine.sequence import FinishReason, Sequence, SequenceStatus


class Gate:
    """Adapter slots stand-in: which keys are ready, and pin counts."""

    def __init__(self, ready: set[str]) -> None:
        self.ready = set(ready)
        self.pins: Counter[str] = Counter()

    def is_ready(self, key: str) -> bool:
        return key in self.ready

    def pin(self, key: str) -> None:
        assert key in self.ready
        self.pins[key] += 1

    def unpin(self, key: str) -> None:
        assert self.pins[key] > 0
        self.pins[key] -= 1


def make(num_blocks=64, block_size=4, max_seqs=8, max_tokens=16, max_len=64, gate=None):
    cfg = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=max_tokens, max_model_len=max_len)
    return Scheduler(cfg, BlockManager(num_blocks, block_size), gate)


_arrival = iter(range(10**9))


def seq(rid: str, n: int, max_tokens: int = 8, key: str | None = None) -> Sequence:
    prompt = [random.randrange(1000) for _ in range(n)]
    return Sequence(rid, prompt, n, SamplingParams(max_tokens=max_tokens, temperature=0), key, next(_arrival))


def next_token(tokens: list[int]) -> int:
    """A deterministic stand-in model: the next token depends on the whole history."""
    return hash(tuple(tokens)) % 1000


def run(sched: Scheduler, max_steps: int = 1000) -> tuple[dict[str, list[int]], list]:
    """Steps to completion with the stand-in model; returns outputs and each step's schedule."""
    outs: dict[str, list[int]] = {}
    steps = []
    for _ in range(max_steps):
        if not sched.has_unfinished():
            break
        out = sched.schedule()
        steps.append(out)
        # every scheduled chunk must have a KV slot for each of its tokens
        for s in out.scheduled:
            assert len(s.seq.block_table) * sched.blocks.block_size >= s.start + s.num_new_tokens
        sampled = {s.seq.request_id: next_token(s.seq.token_ids) for s in out.scheduled if s.sample}
        for q in sched.update(out, sampled):
            if q.num_output_tokens >= q.params.max_tokens:
                sched.finish(q, FinishReason.LENGTH)
                outs[q.request_id] = q.output_token_ids
    return outs, steps


def test_chunked_prefill_respects_token_budget_and_keeps_decodes_running():
    sched = make(max_tokens=8)
    short = seq("short", 3, max_tokens=20)
    sched.add(short)
    out = sched.schedule()
    sched.update(out, {"short": 1})
    long = seq("long", 30)
    sched.add(long)
    chunks = []
    for _ in range(5):
        out = sched.schedule()
        assert out.num_batched_tokens <= 8
        ids = {s.seq.request_id: s for s in out.scheduled}
        assert ids["short"].num_new_tokens == 1          # the decode runs every step
        chunks.append(ids["long"].num_new_tokens if "long" in ids else 0)
        sampled = {s.seq.request_id: 7 for s in out.scheduled if s.sample}
        sched.update(out, sampled)
    assert chunks[:4] == [7, 7, 7, 7] and sum(chunks) >= 30
    assert long.num_computed_tokens == 30 and long.num_output_tokens >= 1


def test_limits_max_num_seqs():
    sched = make(max_seqs=3, max_tokens=100)
    for i in range(5):
        sched.add(seq(f"r{i}", 4))
    out = sched.schedule()
    assert [s.seq.request_id for s in out.scheduled] == ["r0", "r1", "r2"]
    assert len(sched.waiting) == 2


def test_preemption_and_recompute_give_the_same_tokens():
    random.seed(1)
    reqs = [seq(f"r{i}", random.randint(3, 12), max_tokens=random.randint(4, 14)) for i in range(8)]
    clones = [Sequence(r.request_id, list(r.token_ids), r.num_prompt_tokens, r.params, None, r.arrival)
              for r in reqs]
    roomy = make(num_blocks=200)
    for r in reqs:
        roomy.add(r)
    expected, _ = run(roomy)
    tight = make(num_blocks=9, max_len=28)       # 36 slots for 8 sequences of up to 26 tokens
    for r in clones:
        tight.add(r)
    got, steps = run(tight)
    assert sum(len(s.preempted) for s in steps) > 0, "the budget was meant to force preemption"
    assert got == expected
    assert tight.blocks.num_free_blocks == tight.blocks.num_blocks


def test_preempts_the_newest_sequence_first():
    sched = make(num_blocks=4, block_size=4, max_tokens=64)
    a, b = seq("a", 4, max_tokens=20), seq("b", 8, max_tokens=20)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()                      # prefill: a 1 block, b 2 blocks, 1 free
    sched.update(out, {"a": 1, "b": 2})
    out = sched.schedule()                      # a takes the free block for position 4; b needs a 3rd: preempted
    assert [q.request_id for q in out.preempted] == ["b"]
    assert b.status is SequenceStatus.WAITING and b.num_computed_tokens == 0 and b.block_table == []
    assert a.status is SequenceStatus.RUNNING


def test_cancellation_frees_every_block_and_pin():
    gate = Gate({"x"})
    sched = make(num_blocks=32, gate=gate)
    seqs = [seq(f"r{i}", 5 + i, key="x" if i % 2 else None) for i in range(6)]
    for q in seqs:
        sched.add(q)
    for _ in range(3):
        out = sched.schedule()
        sched.update(out, {s.seq.request_id: 1 for s in out.scheduled if s.sample})
    assert sched.blocks.num_used_blocks > 0 and gate.pins["x"] == 3
    for q in seqs:
        assert sched.abort(q.request_id) is q and q.finish_reason is FinishReason.ABORT
    assert sched.abort("r0") is None
    assert sched.blocks.num_free_blocks == 32 and gate.pins["x"] == 0
    assert not sched.has_unfinished()


def test_adapter_not_ready_waits_without_blocking_others():
    gate = Gate({"ready"})
    sched = make(gate=gate)
    cold, warm, base = seq("cold", 4, key="cold"), seq("warm", 4, key="ready"), seq("base", 4)
    for q in (cold, warm, base):
        sched.add(q)
    out = sched.schedule()
    assert {s.seq.request_id for s in out.scheduled} == {"warm", "base"}
    assert cold.status is SequenceStatus.WAITING and gate.pins == Counter({"ready": 1})
    gate.ready.add("cold")
    sched.update(out, {"warm": 1, "base": 1})
    out = sched.schedule()
    assert "cold" in {s.seq.request_id for s in out.scheduled} and gate.pins["cold"] == 1


def test_preemption_releases_the_adapter_pin():
    gate = Gate({"x"})
    sched = make(num_blocks=3, block_size=4, max_tokens=64, gate=gate)
    a, b = seq("a", 4, max_tokens=20), seq("b", 4, max_tokens=20, key="x")
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    sched.update(out, {"a": 1, "b": 1})
    assert gate.pins["x"] == 1
    out = sched.schedule()                      # both need a 2nd block, one free: b is preempted
    assert [q.request_id for q in out.preempted] == ["b"] and gate.pins["x"] == 0


def test_scheduler_imports_without_torch():
    code = ("import sys; import compute_service.engine.scheduler, compute_service.engine.block_manager; "
            "assert 'torch' not in sys.modules, 'scheduler pulled in torch'")
    subprocess.run([sys.executable, "-c", code], check=True)
