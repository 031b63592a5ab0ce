"""Property: the adapter cache and the engine's scheduler together always make progress.

Random workloads (adapter sizes up to the whole pool, slots fewer than
adapters, KV blocks scarce, load latencies, aborts at random steps) run through
the real `Scheduler` + `BlockManager` and the real `AdapterResidency`, with
a stand-in for the model that only appends a token. Every request must end
within a bound (no "cache full, nothing to evict" deadlock), no adapter may be
evicted while a request that names it is waiting or running, and at the end no
page, slot, pin or KV block may be held for a finished request.
"""
from __future__ import annotations

from hypothesis import HealthCheck, given, settings, strategies as st

from compute_service.adapter_cache.residency import AdapterResidency, Entry
from compute_service.engine.block_manager import BlockManager
from compute_service.engine.sampling_params import SamplingParams
from compute_service.engine.scheduler import Scheduler, SchedulerConfig
from compute_service.engine.sequence import FinishReason, Sequence


@st.composite
def workloads(draw):
    num_pages = draw(st.integers(1, 24))
    max_slots = draw(st.integers(1, 6))
    adapters = draw(st.lists(st.integers(1, num_pages), min_size=1, max_size=10))
    block_size = draw(st.sampled_from([1, 2, 4]))
    max_model_len = 24
    num_blocks = draw(st.integers(-(-max_model_len // block_size), 40))
    reqs = draw(st.lists(st.tuples(
        st.integers(0, 30),                                   # arrival step
        st.one_of(st.none(), st.integers(0, len(adapters) - 1)),
        st.integers(1, 12),                                   # prompt length
        st.integers(1, 12),                                   # max tokens
        st.one_of(st.none(), st.integers(0, 60)),             # abort at step
    ), min_size=1, max_size=30))
    load_delays = draw(st.lists(st.integers(0, 5), min_size=1, max_size=20))
    cfg = SchedulerConfig(max_num_seqs=draw(st.integers(1, 8)), max_num_batched_tokens=draw(st.integers(12, 40)),
                          max_model_len=max_model_len)
    return num_pages, max_slots, adapters, block_size, num_blocks, reqs, load_delays, cfg


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_every_request_finishes_and_nothing_leaks(w):
    num_pages, max_slots, adapter_pages, block_size, num_blocks, reqs, load_delays, cfg = w
    blocks = BlockManager(num_blocks, block_size)
    live: dict[str, Sequence] = {}

    def on_evict(e: Entry) -> None:
        users = [s.request_id for s in live.values() if s.adapter_key == e.key]
        assert not users, f"adapter {e.key} evicted while {users} need it"

    cache = AdapterResidency(num_pages, max_slots, on_evict=on_evict)
    sched = Scheduler(cfg, blocks, adapters=cache)
    loading: dict[str, int] = {}       # key -> step its copy completes
    finished: set[str] = set()
    delays = iter(load_delays * 100)
    total_tokens = sum(p + m for _, _, p, m, _ in reqs)
    bound = 31 + total_tokens * 4 + len(reqs) * 8 + len(adapter_pages) * 6 * len(reqs)

    step = 0
    while len(finished) < len(reqs):
        assert step <= bound, f"no progress after {step} steps: deadlock ({len(finished)}/{len(reqs)} done)"
        for i, (arrive, ad, plen, mtok, abort_at) in enumerate(reqs):
            rid = f"r{i}"
            if arrive == step:
                key = None if ad is None else f"a{ad}"
                if key is not None:
                    cache.want(key, adapter_pages[ad])
                seq = Sequence(rid, [7] * plen, plen, SamplingParams(max_tokens=mtok), key, arrival=i)
                sched.add(seq)
                live[rid] = seq
            if abort_at == step and rid in live:
                _end(sched, cache, live, finished, live[rid], FinishReason.ABORT)
        for key, done_at in list(loading.items()):
            if done_at <= step:
                cache.finish_load(key)
                del loading[key]
        for e in cache.start_loads():
            loading[e.key] = step + next(delays)
        out = sched.schedule()
        grown = sched.update(out, {s.seq.request_id: 3 for s in out.scheduled if s.sample})
        for seq in grown:
            if seq.num_output_tokens >= seq.params.max_tokens:
                _end(sched, cache, live, finished, seq, FinishReason.LENGTH)
        for e in cache.entries():
            assert e.pins == sum(1 for q in sched.running if q.adapter_key == e.key), f"{e.key} pin count"
        cache.check()
        step += 1

    assert not sched.has_unfinished() and blocks.num_used_blocks == 0
    assert all(e.pins == 0 and e.wants == 0 for e in cache.entries())
    assert cache.num_queued == 0
    loaded = sum(e.num_pages for e in cache.entries())
    assert cache.pages.num_used == loaded   # only idle, evictable residents (or loads in flight) hold pages


def _end(sched, cache, live, finished, seq, reason):
    sched.finish(seq, reason)
    if seq.adapter_key is not None:
        cache.unwant(seq.adapter_key)
    del live[seq.request_id]
    finished.add(seq.request_id)
