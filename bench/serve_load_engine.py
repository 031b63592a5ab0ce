"""The in-process side of bench/serve_load.py: the same workload on a bare `LLMEngine`.

Same model folder or file, same adapters (read from the same adapter root and
loaded into the engine's pool), same prompts and concurrency as the served
cases: every request is added at once, the engine is stepped until all are
done, and each step's deltas become the same kind of timeline the load
generator records (sent = when the requests were added; one "message" per
step that gave a request tokens, stamped when the step returned). So TTFT, ITL
and tok/s mean the same on both sides; step times are recorded as well.
"""
from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

from serve_load_client import Request, Timeline
from serve_load_stats import LONG_STEP_S, step_figures, summarize


def build_engine(model: str, device: str, *, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                 max_lora_rank: int, pool_bytes: int, quantization: str = "auto", async_scheduling: bool | None = None
                 ) -> tuple[Any, float]:
    """The engine `loraplex compute` runs over `model` ("" = the default model), built and warmed up as the
    service builds and warms it (same adapter pool and LoRA backend, every kernel compiled and every graph
    captured before the first case); returns it and the warm-up's seconds."""
    from compute_service.build import build_runtime
    from compute_service.config import ComputeConfig
    from compute_service.warmup import warm_up

    async def no_fetch(task_id: int, version: str | None) -> Any:
        raise RuntimeError("the benchmark's engine is given its adapters; it fetches none")

    config = ComputeConfig(model=model, device=device, quantization=quantization, max_num_seqs=max_num_seqs,
                           max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
                           max_lora_rank=max_lora_rank, lora_gpu_cache_bytes=pool_bytes,
                           async_scheduling=async_scheduling)
    rt = build_runtime(config, no_fetch, capture_graphs=False)
    return rt.engine, warm_up(rt, "auto").total_s


def load_adapters(engine: Any, root: Path, names: list[str]) -> float:
    """Reads each named adapter folder and makes it resident; returns the seconds it took."""
    from loraplex.formats import load_adapter

    t = time.perf_counter()
    for name in names:
        engine.add_adapter(name, load_adapter(root / name))
    return time.perf_counter() - t


def run_case(engine: Any, requests: list[Request], max_tokens: int, tag: str, max_in_flight: int = 0,
             sampling: dict | None = None) -> tuple[list[Timeline], list[tuple[float, float, float, int]]]:
    """Requests added at their arrival offsets (all at once for a burst), at most `max_in_flight` (0: all)
    in the engine at a time, stepped to the end; the timelines and every step's (start, GPU work queued,
    end, requests added just before it).

    A request is sent when it is added: at its arrival, or when an earlier one finished if the cap held it
    back, as the load generator's semaphore does."""
    from compute_service.engine import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, **{"temperature": 0.0, **(sampling or {})})
    pending = sorted(requests, key=lambda r: r.arrival_s)
    cap = max_in_flight or len(pending)
    t0 = time.monotonic()
    by_id: dict[str, Timeline] = {}
    steps: list[tuple[float, float, float, int]] = []
    launched = [0.0]
    engine.on_launched = lambda: launched.__setitem__(0, time.monotonic())
    in_flight = added = 0
    while pending or engine.has_unfinished():
        now = time.monotonic()
        while pending and in_flight < cap and t0 + pending[0].arrival_s <= now:
            r = pending.pop(0)
            rid = f"{tag}-{r.index}"
            engine.add_request(rid, r.prompt, params, r.lora)
            by_id[rid] = Timeline(r.index, t0 + r.arrival_s, now)
            in_flight += 1
            added += 1
        if not engine.has_unfinished():
            time.sleep(max(0.0, t0 + pending[0].arrival_s - time.monotonic()))
            continue
        ts = time.monotonic()
        launched[0] = ts
        outs = engine.step()
        te = time.monotonic()
        steps.append((ts, launched[0], te, added))
        added = 0
        for o in outs:
            tl = by_id.get(o.request_id)
            if tl is None:
                continue
            if o.new_token_ids:
                tl.messages.append((te, len(o.new_token_ids)))
            if o.finished:
                tl.finish_reason = o.finish_reason
                in_flight -= 1
    engine.on_launched = None
    return sorted(by_id.values(), key=lambda t: t.index), steps


def measure(engine: Any, requests: list[Request], max_tokens: int, tag: str, max_in_flight: int = 0,
            sampling: dict | None = None) -> dict:
    """Warm-up (3 tokens, all at once) then the timed run (`sampling`: SamplingParams fields over greedy, e.g.
    temperature and top_p); the case's figures plus step times, and the
    steps over LONG_STEP_S as (ms, requests added just before: a prefill) to see where long steps come from."""
    run_case(engine, [dataclasses.replace(r, arrival_s=0.0) for r in requests[:max_in_flight or None]], 3,
             f"{tag}w", sampling=sampling)
    timelines, steps = run_case(engine, requests, max_tokens, tag, max_in_flight, sampling)
    res = summarize(timelines)
    trace = dict(start=[s[0] for s in steps], launched=[s[1] for s in steps], end=[s[2] for s in steps])
    res.update(step_figures(trace, steps[0][0], steps[-1][0]))
    res["long_steps"] = [(round((e - st) * 1e3, 2), n) for st, _, e, n in steps if e - st > LONG_STEP_S][:40]
    return res
