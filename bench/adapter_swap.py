"""Adapter swap benchmark: a running batch decodes while cold adapters page into the GPU cache.

Model: a random Llama-3-8B-shaped decoder (bf16, built on the GPU; no download).
Adapters: 8B-shaped, every module (q k v o gate up down) of every layer, rank 16
and 64 alternating (84 MB and 335 MB of factors, 132 MB and 528 MB of padded
rows). Each load goes the service's path: fetch (from host memory) ->
structural checks, the factors (not the padding) gathered by a few threads
into a ring of pinned buffers, each copied to the device on a side stream as
the next fills -> packed into pool pages -> resident at the next step boundary. Loads are issued as prefetches so the batch's own work
is unchanged and any slowdown is the loads' doing.

Reports: pinned and pageable host-to-device bandwidth; per adapter its load
latency, staging time and copy time (device events) and the copy time's
ratio to a plain pinned copy of the same bytes; the running batch's p50/p99
inter-token latency, quiet and during the load storm.

    python bench/adapter_swap.py --out bench/results/adapter_swap.json [--tiny]
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import re
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from compute_service.adapter_cache.layout import module_features  # noqa: E402
from compute_service.adapter_cache.staging import PinnedRing  # noqa: E402
from compute_service.build import build_runtime  # noqa: E402
from compute_service.config import ComputeConfig  # noqa: E402
from compute_service.engine.loader import LoadedModel  # noqa: E402
from compute_service.engine.model import LlamaModel  # noqa: E402
from compute_service.engine.sampling_params import SamplingParams  # noqa: E402
from compute_service.engine.spec import ModelSpec  # noqa: E402
from compute_service.engine.weights import build_weights  # noqa: E402
from loraplex.formats.adapter import Adapter  # noqa: E402

LLAMA3_8B = dict(num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=8, head_dim=128,
                 intermediate_size=14336, vocab_size=128256)
TINY = dict(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128,
            vocab_size=256)


def random_model(dims: dict, device: torch.device, dtype: torch.dtype) -> LoadedModel:
    spec = ModelSpec(architecture="llama", rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=4096,
                     tie_word_embeddings=True, eos_token_ids=(), name="random-llama3-8b-shape", **dims)
    h, q, kv, i, v = spec.hidden_size, spec.q_size, spec.kv_size, spec.intermediate_size, spec.vocab_size
    shapes = [(r"embed_tokens", (v, h)), (r"q_proj", (q, h)), (r"k_proj", (kv, h)), (r"v_proj", (kv, h)),
              (r"o_proj", (h, q)), (r"gate_proj|up_proj", (i, h)), (r"down_proj", (h, i)), (r"norm", (h,))]
    gen = torch.Generator(device=device).manual_seed(0)

    def get(name: str) -> torch.Tensor | None:
        if name.endswith(".bias"):
            return None
        shape = next(s for pat, s in shapes if re.search(pat, name))
        if len(shape) == 1:
            return torch.ones(shape, device=device, dtype=dtype)
        return torch.randn(shape, device=device, dtype=dtype, generator=gen) * (shape[1] ** -0.5)

    weights, fp = build_weights(spec, get, dtype, device)
    return LoadedModel(spec, LlamaModel(spec, weights, 4096), fp, Path("random-llama3-8b-shape"), None)


def random_adapter(spec: ModelSpec, rank: int, seed: int, device: torch.device) -> Adapter:
    """All modules of all layers at `rank`, built on the device, then kept in pageable host memory."""
    feats = module_features(spec)
    mods = (1, 2, 3, 4, 5, 6, 7)
    width = max(rank * (fi + fo) for fi, fo in feats.values())
    gen = torch.Generator(device=device).manual_seed(seed)
    w = torch.zeros(spec.num_layers * len(mods), width, dtype=torch.bfloat16, device=device)
    cfg, in_out = [], []
    for layer in range(spec.num_layers):
        for m in mods:
            fi, fo = feats[m]
            row = len(cfg)
            w[row, : rank * (fi + fo)] = torch.randn(rank * (fi + fo), device=device, generator=gen) * 0.01
            cfg.append([m, layer, rank])
            in_out.append((fi, fo))
    return Adapter(config=np.asarray(cfg, dtype=np.int32), weights=w.cpu(), in_out=tuple(in_out))


def h2d_gbps(num_bytes: int, pinned: bool, device: torch.device) -> float:
    src = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=pinned)
    src.fill_(1)
    dst = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    best = float("inf")
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src, non_blocking=pinned)
        b.record()
        b.synchronize()
        best = min(best, a.elapsed_time(b) / 1e3)
    return num_bytes / best / 1e9


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q)) if xs else float("nan")


async def decode_phase(rt, batch: int, steps: int, vocab: int, warm_key_task: int | None,
                       storm: list[tuple[int, int]] | None, gap_s: float) -> dict:
    """Runs `batch` long decodes; returns the inter-token gaps seen after warm-up (and load records)."""
    gaps: list[float] = []
    rng = np.random.default_rng(1)
    started = asyncio.Event()
    stop_at = {"t": float("inf")}

    async def one(i: int) -> None:
        prompt = rng.integers(0, vocab, 32).tolist()
        tid = warm_key_task if (warm_key_task is not None and i % 2) else None
        last = None
        n = 0
        async for out in rt.runner.generate(f"d{id(gaps)}-{i}", prompt, SamplingParams(
                max_tokens=steps, temperature=0.0, ignore_eos=True), tid, ""):
            now = time.perf_counter()
            n += len(out.new_token_ids)
            if n >= 10 and i == 0:
                started.set()
            if last is not None and n > 10 and now < stop_at["t"]:
                gaps.append(now - last)
            last = now

    tasks = [asyncio.create_task(one(i)) for i in range(batch)]
    loads = []
    if storm is not None:
        await started.wait()
        gaps.clear()                      # measure only while the storm runs
        futs = []
        for task_id, _rank in storm:
            t0 = time.perf_counter()
            futs.append((task_id, t0, rt.runner.prefetch(task_id, "")))
            await asyncio.sleep(gap_s)
        for task_id, t0, f in futs:
            await f
        key_of = {t: f"{t}@" for t, _ in storm}
        while not all(rt.slots.is_ready(key_of[t]) or rt.slots.timings.get(key_of[t]) and
                      rt.slots.timings[key_of[t]].done_at for t, _ in storm):
            await asyncio.sleep(0.002)
        stop_at["t"] = time.perf_counter()
        for task_id, t0, _ in futs:
            tm = rt.slots.timings[key_of[task_id]]
            loads.append(load_record(task_id, dict(storm)[task_id], tm, t0))
    await asyncio.gather(*tasks)
    return dict(gaps=gaps, loads=loads)


def load_record(task_id: int, rank: int, tm, t0: float) -> dict:
    """One load's figures: request -> resident latency, and where the time went."""
    return dict(task_id=task_id, rank=rank, bytes=tm.num_bytes, mode=tm.mode,
                latency_ms=(tm.done_at - t0) * 1e3, fetch_and_upload_ms=(tm.staged_at - t0) * 1e3,
                wait_for_pages_ms=(tm.copy_started_at - tm.staged_at) * 1e3,
                upload_device_ms=tm.upload_ms, upload_host_ms=tm.upload_host_ms, pack_device_ms=tm.copy_ms,
                upload_gbps=tm.num_bytes / (tm.upload_ms * 1e6) if tm.upload_ms else 0.0)


async def isolated_loads(rt, adapters_by_rank: dict[int, int], mode: str) -> list[dict]:
    """Loads with no batch running: the pipeline's own latency (pinned ring or pageable memory)."""
    rt.slots.upload_mode = mode
    out = []
    for rank, task_id in adapters_by_rank.items():
        key = f"{task_id}@"
        rt.slots.drop_staged(key)
        await rt.runner.drop(task_id)
        t0 = time.perf_counter()
        await rt.runner.prefetch(task_id, "")
        while not rt.slots.is_ready(key):
            await asyncio.sleep(0.0005)
        out.append(load_record(task_id, rank, rt.slots.timings[key], t0))
        await rt.runner.drop(task_id)
    rt.slots.upload_mode = "ring"
    return out


def summary(gaps: list[float]) -> dict:
    ms = [g * 1e3 for g in gaps]
    return dict(num_gaps=len(ms), p50_ms=pct(ms, 50), p90_ms=pct(ms, 90), p99_ms=pct(ms, 99),
                mean_ms=statistics.fmean(ms) if ms else 0)


def storm_vs_quiet(quiet: dict, storm: dict) -> dict:
    """Storm over quiet for each latency figure of `summary`."""
    return {f"{k[:-3]}_ratio": storm[k] / quiet[k] for k in ("p50_ms", "p90_ms", "p99_ms") if quiet[k]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results/adapter_swap.json")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (a dry run of the script)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--num-adapters", type=int, default=16)
    ap.add_argument("--gap-ms", type=float, default=40.0, help="time between cold loads")
    ap.add_argument("--repeats", type=int, default=3,
                    help="quiet + storm pairs (figures pooled over them, and per repeat)")
    ap.add_argument("--pool-gib", type=float, default=4.0)
    ap.add_argument("--commit", default="")
    ap.add_argument("--copy-threads", type=int, default=0, help="the pinned ring's copy threads (0: the service's)")
    ap.add_argument("--ring-mib", type=int, default=0, help="each ring buffer's MiB (0: the service's)")
    ap.add_argument("--ring-buffers", type=int, default=0, help="ring buffers (0: the service's)")
    ap.add_argument("--both-intervals", action="store_true",
                    help="also run quiet + storm under Python's default 5 ms thread switch interval")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    dims = TINY if args.tiny else LLAMA3_8B
    t = time.perf_counter()
    loaded = random_model(dims, device, dtype)
    print(f"model built in {time.perf_counter() - t:.1f}s", flush=True)
    spec = loaded.spec
    adapters = {1000 + i: random_adapter(spec, (16, 64)[i % 2], seed=i, device=device)
                for i in range(args.num_adapters)}
    adapters[1] = random_adapter(spec, 16, seed=99, device=device)   # the warm one the batch uses

    async def fetch(task_id: int, version: str | None) -> Adapter:
        return adapters[task_id]

    cfg = ComputeConfig(model="", device=str(device), dtype="bfloat16" if cuda else "float32", max_lora_rank=64,
                        lora_gpu_cache_bytes=int(args.pool_gib * 2**30) if not args.tiny else 64 << 20,
                        max_num_seqs=max(64, args.batch), max_num_batched_tokens=2048, max_model_len=1024,
                        kv_cache_bytes=(8 << 30) if cuda else (64 << 20))
    rt = build_runtime(cfg, fetch, loaded=loaded)
    if cuda and (args.copy_threads or args.ring_mib or args.ring_buffers):
        old = rt.slots.ring
        rt.slots.ring = PinnedRing(args.ring_mib << 20 or old.buffers[0].numel(),
                                   args.ring_buffers or len(old.buffers), args.copy_threads or old.copy_threads)
    ring = rt.slots.ring
    result: dict = dict(
        bench="adapter_swap", device=torch.cuda.get_device_name() if cuda else "cpu", commit=args.commit,
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        torch=torch.__version__, model=dict(dims, dtype=str(dtype)), batch=args.batch, steps=args.steps,
        pool=dict(bytes=rt.slots.layout.pool_bytes, page_bytes=rt.slots.layout.page_bytes,
                  pages=rt.slots.layout.num_pages, max_slots=rt.slots.layout.max_slots),
        gap_ms=args.gap_ms,
        ring=dict(buffer_bytes=ring.buffers[0].numel(), buffers=len(ring.buffers), copy_threads=ring.copy_threads)
        if ring is not None else None)
    if cuda:
        nbytes = max(a.num_bytes for a in adapters.values())
        result["h2d_pinned_gbps"] = h2d_gbps(nbytes, True, device)
        result["h2d_pageable_gbps"] = h2d_gbps(nbytes, False, device)
        print(f"H2D pinned {result['h2d_pinned_gbps']:.1f} GB/s, pageable {result['h2d_pageable_gbps']:.1f} GB/s")

    async def run() -> None:
        rt.runner.start()
        try:
            await rt.runner.prefetch(1, "")
            await decode_phase(rt, args.batch, 40, spec.vocab_size, 1, None, 0)   # compile, warm up
            for mode in ("ring", "pageable"):
                result[f"isolated_loads_{mode}"] = await isolated_loads(rt, {16: 1000, 64: 1001}, mode)
            # Python's default thread switch interval, then the service's default (ComputeConfig).
            for label, interval in [("service", cfg.gil_switch_interval_us / 1e6)] + \
                    ([("py_default", 0.005)] if args.both_intervals else []):
                sys.setswitchinterval(interval)
                quiet_gaps, storm_gaps, loads, repeats = [], [], [], []
                for _ in range(args.repeats):
                    for t in range(1000, 1000 + args.num_adapters):
                        await rt.runner.drop(t)
                    quiet = await decode_phase(rt, args.batch, args.steps, spec.vocab_size, 1, None, 0)
                    storm_list = [(1000 + i, (16, 64)[i % 2]) for i in range(args.num_adapters)]
                    storm = await decode_phase(rt, args.batch, args.steps, spec.vocab_size, 1, storm_list,
                                               args.gap_ms / 1e3)
                    q, st = summary(quiet["gaps"]), summary(storm["gaps"])
                    repeats.append(dict(quiet=q, storm=st, **storm_vs_quiet(q, st)))
                    quiet_gaps += quiet["gaps"]
                    storm_gaps += storm["gaps"]
                    loads += storm["loads"]
                result[f"switch_interval_{label}"] = dict(
                    interval_s=interval, quiet=summary(quiet_gaps), storm=summary(storm_gaps), loads=loads,
                    repeats=repeats)
        finally:
            await rt.runner.stop()

    asyncio.run(run())
    pinned = result.get("h2d_pinned_gbps")
    main_run = result["switch_interval_service"]
    result["quiet"], result["storm"], result["loads"] = main_run["quiet"], main_run["storm"], main_run["loads"]
    all_loads = result["loads"] + result.get("switch_interval_py_default", {}).get("loads", []) + [
        ld for mode in ("ring", "pageable") for ld in result.get(f"isolated_loads_{mode}", [])]
    for ld in all_loads:
        if pinned:
            ld["pinned_copy_ideal_ms"] = ld["bytes"] / (pinned * 1e9) * 1e3
            ld["latency_vs_pinned_copy"] = ld["latency_ms"] / ld["pinned_copy_ideal_ms"]
            ld["upload_vs_pinned_copy"] = ld["upload_device_ms"] / ld["pinned_copy_ideal_ms"]
    for rank in (16, 64):
        sel = [ld for ld in result["loads"] if ld["rank"] == rank]
        if sel:
            result[f"rank{rank}"] = dict(
                bytes=sel[0]["bytes"], latency_ms_p50=pct([s["latency_ms"] for s in sel], 50),
                upload_device_ms_p50=pct([s["upload_device_ms"] for s in sel], 50),
                pack_device_ms_p50=pct([s["pack_device_ms"] for s in sel], 50),
                fetch_and_upload_ms_p50=pct([s["fetch_and_upload_ms"] for s in sel], 50))
    for label in ("py_default", "service"):
        run_ = result.get(f"switch_interval_{label}")
        if run_ is None:
            continue
        pooled = storm_vs_quiet(run_["quiet"], run_["storm"])
        run_["p99_ratio_storm_vs_quiet"] = pooled.get("p99_ratio")
        run_["p90_ratio_storm_vs_quiet"] = pooled.get("p90_ratio")
        run_["p50_ratio_storm_vs_quiet"] = pooled.get("p50_ratio")
        # One repeat's p99 rests on ~1% of its gaps (a dozen steps): its spread across repeats says how
        # much a single figure can be trusted.
        run_["p99_ratio_per_repeat"] = [r.get("p99_ratio") for r in run_["repeats"]]
    for key in ("p99_ratio_storm_vs_quiet", "p90_ratio_storm_vs_quiet", "p50_ratio_storm_vs_quiet",
                "p99_ratio_per_repeat"):
        result[key] = main_run[key]
    brief = {k: v for k, v in result.items() if k != "loads" and not k.startswith(("switch_", "isolated_"))}
    print(json.dumps(brief, indent=1))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
