"""Where a decode step's time goes, kernel by kernel: the engine of bench/multi_lora.py (8B shape, random
weights, CUDA graphs) under the profiler, per case and batch.

For each case it decodes a few warm-up steps, then profiles `--steps` engine steps and prints
- the device time per step of each kernel name, with its launches per step (what the graph and the
  eager ops around it run);
- the GPU timeline per step: wall span, busy time and idle time, and the largest idle gaps with the
  kernels on either side (a gap before the graph's first kernel is the host still launching it; a gap
  after the token read-back is the host between two steps).
- the device time kernels spent running beside each other (`overlap_us`: summed kernel time minus busy
  time), which is what the dependent launches of kernels/pdl.py buy;
- with `--trace N`, the first N kernels of the last profiled step with start and end (us from the
  step's first kernel), to read which launches ran beside which, and per projection of a layer (q/k/v, o,
  gate/up, down) the time from the end of the kernel that writes its x (the norm, attention, the SwiGLU) to the
  projection's end, and from its own start to its end, averaged over the layers the trace holds
  (`projection_spans`): what a projection costs on the step's path.
`--bits 4` runs the 4-bit base of bench/quant_decode.py (every projection quantized on the GPU, group 128).
Under the profiler the host runs slower, so gaps are larger than in an unprofiled run: compare cases
and modes with each other, not with bench/multi_lora.py's figures. Nor is a profiled step the graph's replay
on the device: a one-row norm split over 16 programs made a layer 1.6 us shorter here and the unprofiled
step 0.04 ms longer (docs/quantization-performance.md, "Inline LoRA at one token"); decide small effects by A/B runs of
bench/quant_decode.py, and read traces for where the time goes.

    python3 bench/step_profile.py --cases base:1,distinct_r16_qkv:32 [--no-async-scheduling] [--out p.json]
    python3 bench/step_profile.py --bits 4 --cases base:1,distinct_r16_all:1 --trace 80 --out p.json
    .venv/bin/python bench/step_profile.py --smoke          # checks the script on CPU (CPU ops, no timeline)
"""
from __future__ import annotations

import argparse
import collections
import datetime
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from multi_lora import ENGINE_CASES, LLAMA3_8B, SMOKE, adapter_rows, build_engine, build_hf, case_keys  # noqa: E402


def kernel_table(events: list, steps: int, top: int) -> list[dict]:
    """Per kernel name: microseconds and launches per step, the largest first."""
    agg: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for name, start, end in events:
        agg[name][0] += 1
        agg[name][1] += end - start
    rows = [dict(kernel=n, us_per_step=t / steps, launches_per_step=c / steps) for n, (c, t) in agg.items()]
    return sorted(rows, key=lambda r: -r["us_per_step"])[:top]


def timeline(events: list, steps: int, top: int) -> dict:
    """Span, busy and idle microseconds per step, and the largest idle gaps (> 3 us) by neighbours."""
    events = sorted(events, key=lambda e: e[1])
    if not events:
        return dict(span_us=0.0, busy_us=0.0, idle_us=0.0, gaps=[])
    busy, end, prev = 0.0, events[0][1], events[0][0]
    gaps: dict[tuple[str, str], list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for name, s, e in events:
        if s - end > 3.0:
            gaps[(prev, name)][0] += 1
            gaps[(prev, name)][1] += s - end
        busy += max(0.0, e - max(s, end))
        if e > end:
            end, prev = e, name
    span = end - events[0][1]
    summed = sum(e - s for _, s, e in events)
    top_gaps = sorted(gaps.items(), key=lambda kv: -kv[1][1])[:top]
    return dict(span_us=span / steps, busy_us=busy / steps, idle_us=(span - busy) / steps,
                overlap_us=(summed - busy) / steps,
                gaps=[dict(after=a, before=b, us_per_step=t / steps, per_step=c / steps)
                      for (a, b), (c, t) in top_gaps])


def last_step(events: list, steps: int, first: int) -> list[dict]:
    """The first `first` kernels of the last of `steps` equal steps (the events split evenly by count, in
    start order), start and end in us from that step's first kernel."""
    events = sorted(events, key=lambda e: e[1])
    per = len(events) // steps if steps else 0
    step = events[len(events) - per:] if per else []
    t0 = step[0][1] if step else 0.0
    return [dict(kernel=n, start_us=round(s - t0, 2), end_us=round(e - t0, 2)) for n, s, e in step[:first]]


# Kernels that run a layer's base projections (the one-row and tensor-core kernels; the library GEMMs' names vary),
# and those that write their x, in a layer's order.
PROJECTION_KERNELS = ("quant_gemv", "_dense_gemv", "quant_mma", "quant_wgmma", "gemm", "nvjet", "sm90_xmma")
X_WRITERS = ("_add_rms_norm", "_paged_decode", "_add_rms_norm", "_silu_mul")
PROJECTIONS = ("qkv", "o", "gate_up", "down")


def projection_spans(trace: list[dict]) -> dict[str, dict[str, float]]:
    """From `last_step`'s trace: per projection of a layer, the mean over the trace's whole layers of the us from
    the end of the kernel that wrote its x (the latest such kernel that started before it) to its end
    (`from_x_us`), and from its start to its end (`own_us`). The trace's projections are taken four a layer in
    order from its first q/k/v; LoRA launches and other kernels are not projections."""
    sums: dict[str, list[float]] = {p: [0.0, 0.0, 0] for p in PROJECTIONS}
    writer_end: dict[str, float] = {}
    i = 0
    for k in trace:
        name = k["kernel"]
        for w in set(X_WRITERS):
            if name.startswith(w):
                writer_end[w] = k["end_us"]
        if not any(p in name for p in PROJECTION_KERNELS) or "fused" in name:
            continue
        proj, writer = PROJECTIONS[i % 4], X_WRITERS[i % 4]
        i += 1
        if writer not in writer_end:
            continue                           # the first q/k/v of a step follows the embedding, not a norm
        acc = sums[proj]
        acc[0] += k["end_us"] - writer_end[writer]
        acc[1] += k["end_us"] - k["start_us"]
        acc[2] += 1
    return {p: dict(from_x_us=round(a / n, 2), own_us=round(b / n, 2), layers=n)
            for p, (a, b, n) in sums.items() if n}


def profile_case(engine, name: str, batch: int, rows, distinct: bool, loaded: set, steps: int, dev: torch.device,
                 top: int, trace: int = 0) -> dict:
    from compute_service.engine import SamplingParams

    keys = case_keys(engine, name, batch, rows, distinct, loaded)
    params = SamplingParams(max_tokens=steps + 24, temperature=0, ignore_eos=True)
    vocab = engine.spec.vocab_size
    for i, k in enumerate(keys):
        engine.add_request(f"{name}-{batch}-{i}", [(7 * i + j) % vocab for j in range(43)], params, k)
    for _ in range(12):                     # prefill, graph capture, steady decode
        engine.step()
    activity = torch.profiler.ProfilerActivity.CUDA if dev.type == "cuda" else torch.profiler.ProfilerActivity.CPU
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    with torch.profiler.profile(activities=[activity]) as prof:
        for _ in range(steps):
            engine.step()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
    while engine.has_unfinished():
        engine.step()
    want = torch.autograd.DeviceType.CUDA if dev.type == "cuda" else torch.autograd.DeviceType.CPU
    events = [(e.name[:80], e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type == want]
    res = dict(case=name, batch=batch, steps=steps, kernels=kernel_table(events, steps, top))
    if dev.type == "cuda":
        res["timeline"] = timeline(events, steps, top)
    if trace:
        res["trace"] = last_step(events, steps, trace)
        res["projections"] = projection_spans(res["trace"])
    return res


def report(r: dict) -> None:
    tl = r.get("timeline")
    head = f"== {r['case']} B={r['batch']}"
    if tl:
        head += (f": GPU span {tl['span_us']:.0f} us/step, busy {tl['busy_us']:.0f}, idle {tl['idle_us']:.0f}, "
                 f"kernels beside each other {tl['overlap_us']:.0f}")
    print(head, flush=True)
    for k in r["kernels"]:
        print(f"   {k['us_per_step']:8.1f} us/step {k['launches_per_step']:6.1f}/step  {k['kernel']}")
    for g in (tl or {}).get("gaps", []):
        print(f"   idle {g['us_per_step']:7.1f} us/step ({g['per_step']:.1f}/step) after {g['after']} -> before "
              f"{g['before']}")
    for k in r.get("trace", []):
        print(f"   {k['start_us']:9.2f} {k['end_us']:9.2f}  {k['kernel']}")
    for p, v in r.get("projections", {}).items():
        print(f"   {p:8s} from its x {v['from_x_us']:6.2f} us, its own {v['own_us']:6.2f} us ({v['layers']} layers)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="base:1,distinct_r16_qkv:1,distinct_r16_qkv:32",
                    help="comma-separated CASE:BATCH of bench/multi_lora.py's engine cases")
    ap.add_argument("--steps", type=int, default=20, help="profiled decode steps per case")
    ap.add_argument("--top", type=int, default=14, help="kernels and gaps listed per case")
    ap.add_argument("--async-scheduling", default=None, action=argparse.BooleanOptionalAction,
                    help="overlapped decode steps or plain ones (default: the engine's, on with a GPU)")
    ap.add_argument("--bits", type=int, choices=(4, 8), help="quantize every projection (bench/quant_decode.py)")
    ap.add_argument("--act-order", action="store_true", help="with --bits: input channels stored in a random order "
                    "(bench/quant_decode.py --act-order)")
    ap.add_argument("--trace", type=int, default=0, help="print / keep the last step's first N kernels")
    ap.add_argument("--smoke", action="store_true", help="tiny model on CPU: checks the script")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--commit", default="", help="recorded in the JSON (the tree's commit)")
    args = ap.parse_args()
    dev = torch.device("cpu" if args.smoke else "cuda")
    dtype = torch.float32 if args.smoke else torch.bfloat16
    dims = SMOKE if args.smoke else LLAMA3_8B
    wanted = [(c.split(":")[0], int(c.split(":")[1])) for c in args.cases.split(",")]
    by_name = {c[0]: c for c in ENGINE_CASES}
    unknown = [n for n, _ in wanted if n not in by_name]
    if unknown:
        raise SystemExit(f"unknown cases {unknown}; known: {sorted(by_name)}")
    hf = build_hf(dims, dev, dtype)
    engine, _ = build_engine(hf, dev, dtype, max(b for _, b in wanted), 43, 100, [(64, 2)], args.async_scheduling)
    del hf
    if args.bits:
        from quant_decode import quantize_layers
        quantize_layers(engine, args.bits, 32 if args.smoke else 128, args.act_order)
    res: dict = dict(device=torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", commit=args.commit,
                     date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                     command=" ".join(sys.argv), async_scheduling=engine.overlap, bits=args.bits or 16,
                     act_order=bool(args.bits and args.act_order),
                     mlp_ordered_layers=sum(lw.mlp_order is not None for lw in engine.runner.model.weights.layers),
                     cases=[])
    loaded: set[str] = set()
    for name, batch in wanted:
        _, rank, modules, distinct = by_name[name]
        rows = adapter_rows(dims, rank, modules, dev, dtype) if rank else None
        r = profile_case(engine, name, batch, rows, distinct, loaded, args.steps, dev, args.top, args.trace)
        res["cases"].append(r)
        report(r)
    if args.out:
        args.out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
