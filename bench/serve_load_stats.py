"""Figures of bench/serve_load.py from request timelines, and its plot.

A timeline is when a request was sent and, per message that carried tokens,
when it arrived and how many tokens it held (the engine's timelines are built
the same way from its step outputs). From them:
- output tok/s: all output tokens over the span from the first send to the last token;
- decode tok/s: tokens that arrived after every request had its first token, over
  that window (the steady state once prefill is done; burst arrivals only);
- TTFT: first token - sent; end-to-end: last token - sent; TPOT per request:
  (end-to-end - TTFT) / (tokens - 1);
- ITL per token: a message carrying k tokens after a gap g (since the request's
  previous message) gives k samples of g/k, so coalesced messages neither hide
  nor inflate time; ITL per message: the raw gaps g.
Percentiles are p50/p90/p99 with linear interpolation, in milliseconds.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Sequence

PCTS = (50, 90, 99)
LONG_STEP_S = 0.005   # steps longer than this are listed one by one


def percentiles(values: Sequence[float], scale: float = 1e3) -> dict[str, float | None]:
    """{"p50": .., "p90": .., "p99": .., "mean": ..} of `values` times `scale` (None when empty)."""
    if not values:
        return {f"p{p}": None for p in PCTS} | {"mean": None}
    xs = sorted(values)
    out: dict[str, float | None] = {}
    for p in PCTS:
        pos = (len(xs) - 1) * p / 100
        lo, hi = math.floor(pos), math.ceil(pos)
        out[f"p{p}"] = (xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)) * scale
    out["mean"] = sum(xs) / len(xs) * scale
    return out


def step_figures(trace: dict[str, Sequence[float]], t_from: float, t_to: float) -> dict[str, Any]:
    """Host times of the engine steps that started in [t_from, t_to] (seconds, one clock) from a step trace
    (`start`, `launched`, `end` per step): each step's duration (`step_ms`), from its start to its GPU work
    being queued (`launch_ms`: scheduling, inputs, launches), from then to its end (`finish_ms`: waiting
    for the GPU, sampling, bookkeeping), and from its end to the next step's start (`gap_ms`)."""
    starts, launched, ends = trace["start"], trace["launched"], trace["end"]
    idx = [i for i, t in enumerate(starts) if t_from <= t <= t_to]
    gaps = [starts[i + 1] - ends[i] for i in idx if i + 1 < len(starts) and starts[i + 1] <= t_to]
    res = dict(step_ms=percentiles([ends[i] - starts[i] for i in idx]),
               launch_ms=percentiles([launched[i] - starts[i] for i in idx]),
               finish_ms=percentiles([ends[i] - launched[i] for i in idx]),
               gap_ms=percentiles(gaps), num_steps=len(idx))
    tokens = trace.get("tokens")
    if tokens:   # a service's trace: its long steps as (ms, launch part ms, tokens emitted, ms since the first step)
        res["long_steps"] = [(round((ends[i] - starts[i]) * 1e3, 2), round((launched[i] - starts[i]) * 1e3, 2),
                              int(tokens[i]), round((starts[i] - starts[idx[0]]) * 1e3, 1))
                             for i in idx if ends[i] - starts[i] > LONG_STEP_S][:40]
    return res


def summarize(timelines: Sequence[Any]) -> dict[str, Any]:
    """The case's figures from timelines (objects with sent, messages, finish_reason, error)."""
    ok = [t for t in timelines if t.messages and t.finish_reason != "error"]
    errors = sorted({t.error for t in timelines if t.finish_reason == "error"})
    res: dict[str, Any] = dict(num_requests=len(timelines), num_failed=len(timelines) - len(ok),
                               errors=errors[:5])
    if not ok:
        return res
    t0 = min(t.sent for t in ok)
    t_end = max(t.messages[-1][0] for t in ok)
    t_all_started = max(t.messages[0][0] for t in ok)
    tokens = sum(k for t in ok for _, k in t.messages)
    after = sum(k for t in ok for ts, k in t.messages if ts > t_all_started)
    itl_token, itl_msg, tpot = [], [], []
    for t in ok:
        n = sum(k for _, k in t.messages)
        for (prev, _), (ts, k) in zip(t.messages, t.messages[1:]):
            itl_msg.append(ts - prev)
            itl_token.extend([(ts - prev) / k] * k)
        if n > 1:
            tpot.append((t.messages[-1][0] - t.messages[0][0]) / (n - 1))
    res.update(
        output_tokens=tokens, duration_s=t_end - t0, output_tok_per_s=tokens / (t_end - t0),
        decode_tok_per_s=after / (t_end - t_all_started) if t_end > t_all_started else None,
        requests_per_s=len(ok) / (t_end - t0),
        tokens_per_message=tokens / sum(len(t.messages) for t in ok),
        ttft_ms=percentiles([t.messages[0][0] - t.sent for t in ok]),
        e2e_ms=percentiles([t.messages[-1][0] - t.sent for t in ok]),
        tpot_ms=percentiles(tpot), itl_ms=percentiles(itl_token), itl_message_ms=percentiles(itl_msg))
    return res


def ratios(served: dict, engine: dict) -> dict[str, float | None]:
    """served / engine for throughput, engine / served for latencies (1.0 = as fast as the engine)."""
    def div(a: float | None, b: float | None) -> float | None:
        return a / b if a and b else None

    return dict(output_tok_per_s=div(served.get("output_tok_per_s"), engine.get("output_tok_per_s")),
                decode_tok_per_s=div(served.get("decode_tok_per_s"), engine.get("decode_tok_per_s")),
                itl_p50=div(engine.get("itl_ms", {}).get("p50"), served.get("itl_ms", {}).get("p50")),
                itl_p99=div(engine.get("itl_ms", {}).get("p99"), served.get("itl_ms", {}).get("p99")))


def plot(res: dict, out: Path) -> bool:
    """Served vs engine output tok/s by concurrency (per workload, burst), and served ITL p50/p99."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return False
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 5))
    for i, (workload, per_arrival) in enumerate(res["served"].items()):
        color = f"C{i}"
        served = per_arrival.get("burst", {})
        pts = sorted((int(c), r.get("output_tok_per_s")) for c, r in served.items() if r.get("output_tok_per_s"))
        if pts:
            ax1.plot(*zip(*pts), "-o", color=color, label=f"served, {workload}")
        eng = res.get("engine", {}).get(workload, {})
        pts = sorted((int(c), r.get("output_tok_per_s")) for c, r in eng.items() if r.get("output_tok_per_s"))
        if pts:
            ax1.plot(*zip(*pts), ":s", color=color, label=f"engine, {workload}")
        for side, figs, mark in (("served", served, "o"), ("engine", eng, "s")):
            for pct, style in (("p50", "-"), ("p99", "--")):
                pts = sorted((int(c), r["itl_ms"][pct]) for c, r in figs.items() if r.get("itl_ms", {}).get(pct))
                if pts:
                    ax2.plot(*zip(*pts), style + mark, color=color, alpha=1.0 if side == "served" else 0.45,
                             label=f"{side} ITL {pct}, {workload}")
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("concurrent streams (burst arrivals)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    ax1.set_ylabel(f"output tokens/s (prompt {res['flags']['prompt_len']}, output {res['flags']['output_len']})")
    ax2.set_ylabel("inter-token latency per token, ms")
    fig.suptitle(f"loraplex served vs engine: {res['model']}, {res['device']}")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    return True
