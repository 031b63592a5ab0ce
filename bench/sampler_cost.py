"""What the engine's sampler (`compute_service.engine.sampler.sample_tokens`) costs a decode step on the GPU: the 8B's
vocabulary (128256), batches of 1-64 rows, greedy rows and sampled ones (temperature alone, with top-p, with
top-k), each row with its own seed as the engine gives every request. Each call is timed from its launch to
its tokens being ready (CUDA events around it, the host's launch work inside: a step pays both), median of
`--iters`, the logits rotated over 4 copies; and the GPU's part alone (the call queued behind a spin, as the
engine queues it behind the step's graph), with the host's part alone (the time the call takes to return). The
bytes a call must read (the logits once) over copy bandwidth is the floor; the benchmarks elsewhere run greedy
requests only. Rows are randn * 4 (a top-p 0.9 nucleus of ~90 tokens at temperature 0.8; the runs up to 5ab306d
drew randn * 3, ~1100 kept), and for `top_p_flat` randn * 0.5 (~95,000 kept: the threshold's exact path).

    python3 bench/sampler_cost.py --commit "$(git rev-parse --short HEAD)" --out bench/results/sampler_cost.json
    python3 bench/sampler_cost.py --device cpu --batches 1,8 --vocab 4096 --iters 3 --out s.json   # checks the script
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from compute_service.engine.sampler import sample_tokens  # noqa: E402
from compute_service.engine.sampling_params import SamplingParams  # noqa: E402

CASES = {
    "greedy": SamplingParams(temperature=0.0),
    "temperature": SamplingParams(temperature=0.8),
    "top_p": SamplingParams(temperature=0.8, top_p=0.9),
    "top_k": SamplingParams(temperature=0.8, top_k=50),
    "top_p_flat": SamplingParams(temperature=0.8, top_p=0.9),    # on flat rows: a nucleus of thousands of tokens
}
FLAT = 0.5      # the flat rows' logits are randn * FLAT (the others randn * 4)


def nucleus_tokens(logits: torch.Tensor, params: SamplingParams) -> int:
    """Median count of tokens a row keeps under top-k / top-p (a float64 sort), 0 when neither is set: with top-p
    above 1024 (`kernels.sample_threshold`'s candidates) the GPU finds the threshold by its slower exact path."""
    if params.top_k <= 0 and params.top_p >= 1.0:
        return 0
    vals = (logits.double() / params.temperature).sort(dim=-1, descending=True).values
    if params.top_k > 0:
        vals = vals[:, :params.top_k]
    probs = vals.softmax(-1)
    return int(((probs.cumsum(-1) - probs) < params.top_p).sum(-1).median())


def time_call(fn, dev: torch.device, iters: int, behind_gpu_work: bool = False,
              host: list[float] | None = None) -> float:
    """Median µs of `fn(i)` from launch to completion. `behind_gpu_work`: queued behind a ~2 ms spin, so its
    launches are all queued before the GPU reaches them and the events time the GPU's work alone (in the engine
    the sampler's launches are queued behind the step's graph the same way); `host` then gets the median µs the
    call took to return (its host work: what an engine step pays on the host)."""
    fn(0)
    times, returned = [], []
    for i in range(iters):
        if dev.type == "cuda":
            torch.cuda.synchronize()
            if behind_gpu_work:
                torch.cuda._sleep(4_000_000)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            t0 = time.perf_counter()
            fn(i)
            returned.append((time.perf_counter() - t0) * 1e6)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        else:
            t0 = time.perf_counter()
            fn(i)
            times.append((time.perf_counter() - t0) * 1e6)
    if host is not None and returned:
        host.append(statistics.median(returned))
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--iters", type=int, default=30)
    args = ap.parse_args()
    dev = torch.device(args.device)
    if dev.type == "cuda":
        from run_header import gpu_run_header
        res: dict = gpu_run_header(dev, args.commit)
        bandwidth = res.get("copy_bandwidth_Bps")
    else:
        res, bandwidth = {"device": "cpu", "commit": args.commit, "torch_threads": torch.get_num_threads(),
                          "date": datetime.now(timezone.utc).isoformat(timespec="seconds")}, None
    res.update(vocab=args.vocab, iters=args.iters, cases={})
    for b in (int(v) for v in args.batches.split(",")):
        for name, params in CASES.items():
            scale = FLAT if name.endswith("_flat") else 4.0
            copies = [torch.randn(b, args.vocab, device=dev) * scale for _ in range(4)]
            seeds = [1000 + r for r in range(b)]
            def call(i: int) -> None:
                sample_tokens(copies[i % 4], [params] * b, seeds, [40 + i] * b)
            us = time_call(call, dev, args.iters)
            host: list[float] = []
            gpu_us = time_call(call, dev, args.iters, True, host) if dev.type == "cuda" else None
            floor_us = None if bandwidth is None else b * args.vocab * 4 / bandwidth * 1e6
            kept = nucleus_tokens(copies[0], params)
            host_us = host[0] if host else None
            res["cases"][f"{name}:{b}"] = {"us": us, "gpu_us": gpu_us, "host_us": host_us, "floor_us": floor_us,
                                           "kept_tokens": kept}
            print(f"{name:12s} batch {b:3d}: {us:9.1f} us" + ("" if gpu_us is None else
                                                              f", GPU {gpu_us:8.1f} us, host {host_us:8.1f} us")
                  + ("" if floor_us is None else f" (floor {floor_us:.2f})") + (f", {kept} kept" if kept else ""),
                  flush=True)
    args.out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
