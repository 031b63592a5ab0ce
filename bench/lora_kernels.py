"""Benchmark of the LoRA kernels (fused, shrink, expand) on Llama-3-8B shapes, against bytes and vLLM's table.

Run on a CUDA GPU (bf16):
    python bench/lora_kernels.py --out bench/results/lora_kernels.json --commit "$(git rev-parse HEAD)"
Every time is the median GPU time of a CUDA-graph replay (CUDA events), with L2
flushed before each replay and inputs rotated over several buffer sets. Minimum
bytes count x read once, each used adapter's rows read once and the output
written once; the fraction is minimum bytes / time / measured copy bandwidth
(read + write bytes of a 1 GiB device copy). Expand and fused also read y (they
add into it): `frac_rmw` counts that read too. The fused kernel (shrink and
expand in one launch) reads x, the adapters' A and B rows, and y, and writes y.
"""
from __future__ import annotations

import argparse
import datetime
import functools
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kernels import LoraBatchMeta, LoraRowTables, pages_needed, write_adapter  # noqa: E402
from kernels.expand import lora_expand_triton  # noqa: E402
from kernels.fused import fused_workspace, lora_fused_triton  # noqa: E402
from kernels.segments import build_segments  # noqa: E402
from kernels.shrink import lora_shrink_triton  # noqa: E402

HIDDEN, KV, INTER, LAYERS = 4096, 1024, 14336, 32
MS = [1, 8, 32, 128, 512, 2048, 8192]
LS = [1, 8, 32]
RANK_SETS = {"16": [16], "64": [64], "mixed": [8, 16, 64]}
PAGE_ELEMS = 65536
ROTATE = 4
DEVICE = "cuda"
# module name -> (dense module index with the default ids 1..7, in_features, out_features)
MODULES = {"q": (0, HIDDEN, HIDDEN), "k": (1, HIDDEN, KV), "v": (2, HIDDEN, KV), "o": (3, HIDDEN, HIDDEN),
           "gate": (4, HIDDEN, INTER), "down": (5, INTER, HIDDEN), "up": (6, HIDDEN, INTER)}
OPS = {"qkv": ["q", "k", "v"], "down": ["down"]}
# vLLM's Triton kernels on an H100 with 3.0 TB/s copy bandwidth (us per M in MS), from the issue.
VLLM_BW = 3.0e12
VLLM_MS = [1, 8, 32, 128, 512, 2048, 8192]
VLLM_US = {
    ("qkv", "shrink", 8, "64"): [18.0, 57.4, 57.3, 23.7, 33.6, 82.1, 295.1],
    ("qkv", "expand", 8, "64"): [16.0, 24.4, 22.8, 25.9, 34.2, 106.6, 397.8],
    ("qkv", "shrink", 32, "16"): [14.1, 24.1, 57.6, 23.4, 28.8, 51.0, 138.9],
    ("qkv", "expand", 32, "16"): [13.5, 26.5, 75.2, 85.2, 134.8, 314.1, 1230.8],
    ("down", "shrink", 32, "16"): [9.3, 11.8, 20.5, 47.9, 55.3, 68.7, 141.2],
    ("down", "expand", 32, "64"): [10.1, 12.2, 22.8, 20.6, 23.6, 41.5, 133.5],
}
SWEEP = {  # one-knob variations around the default configuration, timed when --sweep is given
    "shrink": [{"BLOCK_K": 64}, {"BLOCK_K": 128}, {"BLOCK_K": 256}, {"num_warps": 2}, {"num_warps": 8},
               {"num_stages": 2}, {"num_stages": 4}, {"SPLIT_K": 0.5}, {"SPLIT_K": 2.0}, {"BLOCK_M": 16},
               {"BLOCK_M": 32}, {"BLOCK_M": 64}],
    "fused": [{"SPLIT_K": 0.5}, {"SPLIT_K": 2.0}, {"GROUP_N": 256}, {"GROUP_N": 1024}, {"GROUP_N": 4096},
              {"num_warps": 8}, {"num_stages": 3}],
    "expand": [{"BLOCK_N": 64}, {"BLOCK_N": 256}, {"GROUP_N": 128}, {"GROUP_N": 512}, {"GROUP_N": 2048},
               {"BLOCK_M": 16}, {"BLOCK_M": 32}, {"BLOCK_M": 64}, {"num_warps": 8}, {"num_stages": 1},
               {"num_stages": 3}],
}
KINDS = ("fused", "shrink", "expand")
SWEEP_CASES = {("qkv", 8, "64"), ("qkv", 32, "16"), ("down", 32, "16")}


class GraphTimer:
    """Median GPU time of CUDA-graph replays, one graph per rotating input set, L2 flushed before each."""

    def __init__(self) -> None:
        self.flush = torch.empty(256 << 20, dtype=torch.int8, device=DEVICE)

    def us(self, fns: list, reps: int = 30) -> float:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for fn in fns:
                fn()                                   # compile and warm up outside the capture
        torch.cuda.current_stream().wait_stream(side)
        graphs = []
        for fn in fns:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                fn()
            graphs.append(g)
        for g in graphs:
            g.replay()
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        for i in range(reps):
            self.flush.zero_()
            starts[i].record()
            graphs[i % len(graphs)].replay()
            ends[i].record()
        torch.cuda.synchronize()
        return 1000 * statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


class WallTimer:
    """Host wall-clock stand-in for --smoke runs on CPU (Triton's interpreter); its numbers mean nothing."""

    def us(self, fns: list, reps: int = 1) -> float:
        t0 = time.perf_counter()
        for fn in fns:
            fn()
        return (time.perf_counter() - t0) / len(fns) * 1e6


def copy_bandwidth(timer: GraphTimer) -> float:
    """Best of a few large device copies (fp32 and bf16), counting bytes read plus bytes written."""
    n = 1 << 31 if DEVICE == "cuda" else 1 << 20
    best = 0.0
    for dtype in (torch.float32, torch.bfloat16):
        src = torch.randn(n // torch.finfo(dtype).bits * 8, dtype=dtype, device=DEVICE)
        dst = torch.empty_like(src)
        us = timer.us([lambda: dst.copy_(src)], reps=20)
        best = max(best, 2 * n / (us * 1e-6))
        del src, dst
    return best


def build_pool(num_slots: int, rank_of, modules: list[str], num_layers: int, max_rank: int):
    """A bf16 pool holding `num_slots` random adapters on `modules`, pages shuffled through the pool."""
    tables = LoraRowTables(num_slots, num_layers, max_rank, device=DEVICE)
    shapes = {s: [(rank_of(s), MODULES[m][1], MODULES[m][2]) for m in modules] * num_layers for s in range(num_slots)}
    need = {s: pages_needed(shapes[s], PAGE_ELEMS) for s in range(num_slots)}
    num_pages = sum(need.values())
    pool = torch.empty(num_pages * PAGE_ELEMS, dtype=torch.bfloat16, device=DEVICE)
    order = torch.randperm(num_pages).tolist()
    for s in range(num_slots):
        r = rank_of(s)
        rows = []
        for layer in range(num_layers):
            for m in modules:
                idx, fin, fout = MODULES[m]
                a = torch.randn(r, fin, device=DEVICE, dtype=torch.bfloat16) / fin**0.5
                b = torch.randn(fout, r, device=DEVICE, dtype=torch.bfloat16) / r**0.5
                rows.append((idx + 1, layer, r, a, b))
        pages, order = order[: need[s]], order[need[s]:]
        write_adapter(pool, pages, rows, tables, s, PAGE_ELEMS)
    return pool, tables


def grid(timer: GraphTimer, bw: float, sweep: bool) -> tuple[list[dict], list[dict]]:
    rows, sweeps = [], []
    for op, mods in OPS.items():
        idx = [MODULES[m][0] for m in mods]
        K, outs = MODULES[mods[0]][1], [MODULES[m][2] for m in mods]
        offs = [0] + [sum(outs[: i + 1]) for i in range(len(outs))]
        for L in LS:
            for rs, rset in RANK_SETS.items():
                rank_of = lambda s, rset=rset: rset[s % len(rset)]  # noqa: E731
                pool, tables = build_pool(L, rank_of, mods, 1, max(rset))
                R = tables.max_rank
                meta = LoraBatchMeta(max(MS), L, device=DEVICE)
                for M in MS:
                    ids = (torch.arange(M) % L).to(torch.int32)
                    meta.prepare(ids)
                    used = sorted(set(ids.tolist()))
                    tok_r = sum(rank_of(int(s)) for s in ids.tolist())
                    a_bytes = sum(rank_of(s) for s in used) * K * 2 * len(mods)
                    b_bytes = sum(rank_of(s) for s in used) * sum(outs) * 2
                    xs = [torch.randn(M, K, device=DEVICE, dtype=torch.bfloat16) for _ in range(ROTATE)]
                    so = [torch.empty(len(mods), M, R, device=DEVICE) for _ in range(ROTATE)]
                    ss = [torch.randn(len(mods), M, R, device=DEVICE) for _ in range(ROTATE)]
                    ys = [torch.randn(M, offs[-1], device=DEVICE, dtype=torch.bfloat16) for _ in range(ROTATE)]
                    ws = fused_workspace(M, R, DEVICE)

                    def shrink_fns(cfg=None):
                        return [functools.partial(lora_shrink_triton, x, pool, tables, meta, 0, idx, o, config=cfg)
                                for x, o in zip(xs, so)]

                    def expand_fns(cfg=None):
                        return [functools.partial(lora_expand_triton, s, pool, tables, meta, 0, idx, y, offs, config=cfg)
                                for s, y in zip(ss, ys)]

                    def fused_fns(cfg=None):
                        return [functools.partial(lora_fused_triton, x, pool, tables, meta, 0, idx, y, offs, ws,
                                                  config=cfg) for x, y in zip(xs, ys)]

                    kinds = {
                        "fused": (fused_fns, M * K * 2 + a_bytes + b_bytes + M * offs[-1] * 2, M * offs[-1] * 2),
                        "shrink": (shrink_fns, M * K * 2 + a_bytes + tok_r * len(mods) * 4, 0),
                        "expand": (expand_fns, tok_r * len(mods) * 4 + b_bytes + M * offs[-1] * 2, M * offs[-1] * 2),
                    }
                    for kind, (fns, nbytes, y_read) in kinds.items():
                        if kind not in KINDS:
                            continue
                        us = timer.us(fns())
                        row = dict(op=op, kind=kind, L=L, ranks=rs, M=M, us=round(us, 2), min_bytes=nbytes,
                                   frac=round(nbytes / (us * 1e-6) / bw, 4),
                                   frac_rmw=round((nbytes + y_read) / (us * 1e-6) / bw, 4))
                        ref = VLLM_US.get((op, kind, L, rs))
                        if ref and M in VLLM_MS:
                            theirs = ref[VLLM_MS.index(M)]
                            row["vllm_us"] = theirs
                            # Their time scaled to our copy bandwidth, so the comparison is per byte moved.
                            row["speedup_vs_vllm"] = round(theirs * VLLM_BW / bw / us, 3)
                            row["speedup_vs_vllm_raw_time"] = round(theirs / us, 3)
                        rows.append(row)
                        print(json.dumps(row), flush=True)
                        if sweep and (op, L, rs) in SWEEP_CASES:
                            for var in SWEEP[kind]:
                                cfg = dict(var)
                                if "SPLIT_K" in cfg:
                                    from kernels.fused import fused_config
                                    from kernels.shrink import shrink_config
                                    dev = torch.device(DEVICE)
                                    base = (fused_config(M, K, outs, R, L, dev) if kind == "fused"
                                            else shrink_config(M, K, R, len(mods), L, dev))["SPLIT_K"]
                                    cfg["SPLIT_K"] = max(1, int(base * cfg["SPLIT_K"]))
                                try:
                                    vus = timer.us(fns(cfg), reps=15)
                                except Exception as e:  # a variant the compiler refuses is recorded, not fatal
                                    vus = float("nan")
                                    print("variant failed", cfg, repr(e)[:200], flush=True)
                                sweeps.append(dict(op=op, kind=kind, L=L, ranks=rs, M=M, config=cfg,
                                                   us=round(vus, 2), default_us=round(us, 2)))
                    del xs, so, ss, ys, ws
                del pool, tables
                torch.cuda.empty_cache()
    return rows, sweeps


STEP_MODULES = ["q", "k", "v", "o", "gate", "down", "up"]


def step_launches() -> list[tuple[list[int], int, list[int]]]:
    """(module indices, in features, out features per slice) of a layer's four LoRA launches (read at call
    time, so --smoke's shapes apply)."""
    return [([0, 1, 2], HIDDEN, [HIDDEN, KV, KV]), ([3], HIDDEN, [HIDDEN]),
            ([4, 6], HIDDEN, [INTER, INTER]), ([5], INTER, [HIDDEN])]


def step_buffers(B: int, rank: int) -> list[tuple]:
    """Per launch of a layer: (module indices, slice offsets, x, shrink output [slices, B, rank], y)."""
    bufs = []
    for mods, fin, outs in step_launches():
        offs = [0] + [sum(outs[: i + 1]) for i in range(len(outs))]
        bufs.append((mods, offs, torch.randn(B, fin, device=DEVICE, dtype=torch.bfloat16),
                     torch.empty(len(mods), B, rank, device=DEVICE),
                     torch.randn(B, offs[-1], device=DEVICE, dtype=torch.bfloat16)))
    return bufs


def decode_step(timer: GraphTimer, bw: float, batches: list[int]) -> list[dict]:
    """LoRA time of a whole decode step (7 modules x 32 layers), B tokens with B distinct rank-16 adapters.

    Four ways: the fused kernel (one launch per module group and layer, 128 in all), the same plus the
    step's metadata built on the device (what the engine runs), separate shrink + expand (256 launches),
    and the same with plain launches instead of programmatic dependent ones (`_plain`).
    """
    pool, tables = build_pool(max(batches), lambda s: 16, STEP_MODULES, LAYERS, 16)
    per_adapter = LAYERS * 16 * sum(MODULES[m][1] + MODULES[m][2] for m in STEP_MODULES) * 2
    out = []
    for B in batches:
        meta = LoraBatchMeta(B, tables.max_slots, device=DEVICE)
        ids = torch.arange(B, dtype=torch.int32)
        meta.prepare(ids)
        ws = fused_workspace(B, 16, DEVICE)
        bufs = step_buffers(B, 16)

        def separate(bufs=bufs, meta=meta, cfg=None):
            for layer in range(LAYERS):
                for mods, offs, x, s, y in bufs:
                    lora_shrink_triton(x, pool, tables, meta, layer, mods, s, config=cfg)
                    lora_expand_triton(s, pool, tables, meta, layer, mods, y, offs, config=cfg)

        def fused(bufs=bufs, meta=meta, ws=ws, with_meta=False):
            if with_meta:
                build_segments(meta.slot_ids, B, meta.token_indices, meta.seg_starts, meta.seg_slots,
                               meta.num_segments)
            for layer in range(LAYERS):
                for mods, offs, x, _, y in bufs:
                    lora_fused_triton(x, pool, tables, meta, layer, mods, y, offs, ws)

        floor = B * per_adapter / bw * 1e6
        row = dict(B=B, floor_us=round(floor, 1), adapter_bytes=B * per_adapter, launches=LAYERS * 8,
                   launches_fused=LAYERS * 4)
        variants = (("_fused", functools.partial(fused)), ("_fused_meta", functools.partial(fused, with_meta=True)),
                    ("", functools.partial(separate)), ("_plain", functools.partial(separate, cfg={"PDL": 0})))
        for name, fn in variants:
            try:
                us = timer.us([fn], reps=20)
            except Exception as e:  # keep the other variants; the failure is printed
                print("decode step", name, "failed:", repr(e)[:300], flush=True)
                continue
            row["us" + name] = round(us, 1)
            row["ratio" + name] = round(us / floor, 3)
        out.append(row)
        print(json.dumps(row), flush=True)
    return out


def geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


def summarize(rows: list[dict], steps: list[dict]) -> dict:
    big = [r for r in rows if r["min_bytes"] > 8e6]
    versus = [r["speedup_vs_vllm"] for r in rows if "speedup_vs_vllm" in r]
    by_case: dict[tuple, dict] = {}
    for r in rows:
        by_case.setdefault((r["op"], r["L"], r["ranks"], r["M"]), {})[r["kind"]] = r["us"]
    fused_gain = [(c["shrink"] + c["expand"]) / c["fused"] for c in by_case.values() if len(c) == 3]
    out = {}
    for kind in sorted({r["kind"] for r in rows}):
        mine = [r for r in rows if r["kind"] == kind]
        mine_big = [r for r in big if r["kind"] == kind]
        out[kind] = dict(geomean_frac=round(geomean([r["frac"] for r in mine]), 4),
                         geomean_frac_rmw=round(geomean([r["frac_rmw"] for r in mine]), 4),
                         geomean_frac_over_8MB=round(geomean([r["frac"] for r in mine_big]), 4),
                         cases_over_8MB=len(mine_big), cases_over_8MB_at_50pct=sum(r["frac"] >= 0.5 for r in mine_big))
    return dict(
        per_kind=out,
        geomean_fused_speedup_over_shrink_plus_expand=round(geomean(fused_gain), 3) if fused_gain else None,
        min_fused_speedup_over_shrink_plus_expand=round(min(fused_gain), 3) if fused_gain else None,
        vllm_geomean_frac=0.09, vllm_geomean_frac_over_8MB=0.20,
        geomean_speedup_vs_vllm_table=round(geomean(versus), 3) if versus else None,
        min_speedup_vs_vllm_table=min(versus, default=None),
        decode_step_ratio_to_floor_fused={s["B"]: s.get("ratio_fused") for s in steps},
        decode_step_ratio_to_floor_fused_with_meta={s["B"]: s.get("ratio_fused_meta") for s in steps},
        decode_step_ratio_to_floor={s["B"]: s.get("ratio") for s in steps},
        decode_step_ratio_to_floor_plain={s["B"]: s.get("ratio_plain") for s in steps},
    )


def print_table(rows: list[dict], sweeps: list[dict]) -> None:
    """One line per case family: us / % of copy bandwidth per M (and x vs vLLM's table where it has the case)."""
    keys = sorted({(r["op"], r["kind"], r["L"], r["ranks"]) for r in rows}, key=lambda k: (k[0], k[1], k[2], k[3]))
    for k in keys:
        cells = []
        for r in (r for r in rows if (r["op"], r["kind"], r["L"], r["ranks"]) == k):
            vs = f" {r['speedup_vs_vllm']:.1f}x" if "speedup_vs_vllm" in r else ""
            cells.append(f"{r['us']:.1f}/{100 * r['frac']:.0f}%{vs}")
        print(f"{k[0]:4} {k[1]:6} L={k[2]:<2} r={k[3]:5} " + " | ".join(cells))
    best: dict[tuple, dict] = {}
    for v in sweeps:
        key = (v["op"], v["kind"], v["L"], v["ranks"], v["M"])
        if v["us"] == v["us"] and v["us"] < best.get(key, {"us": v["default_us"]})["us"]:
            best[key] = v
    for key, v in sorted(best.items()):
        print("sweep better:", key, v["config"], v["us"], "vs", v["default_us"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench/results/lora_kernels.json")
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--sweep", action="store_true", help="also time one-knob config variations on a few cases")
    ap.add_argument("--skip-grid", action="store_true")
    ap.add_argument("--kinds", default=",".join(KINDS), help="kernels to time in the grid (fused,shrink,expand)")
    ap.add_argument("--ms", default=None, help="token counts of the grid, comma-separated (default: all)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU under TRITON_INTERPRET=1 (checks the script)")
    args = ap.parse_args()
    torch.manual_seed(0)
    globals()["KINDS"] = tuple(args.kinds.split(","))
    if args.ms:
        globals()["MS"] = [int(m) for m in args.ms.split(",")]
    if args.smoke:
        globals().update(DEVICE="cpu", HIDDEN=64, KV=32, INTER=96, LAYERS=2, MS=[1, 8, 130], LS=[1, 8],
                         ROTATE=2, PAGE_ELEMS=512)
        globals()["MODULES"] = {"q": (0, 64, 64), "k": (1, 64, 32), "v": (2, 64, 32), "o": (3, 64, 64),
                                "gate": (4, 64, 96), "down": (5, 96, 64), "up": (6, 64, 96)}
    timer = GraphTimer() if DEVICE == "cuda" else WallTimer()
    bw = copy_bandwidth(timer)
    print(f"copy bandwidth {bw / 1e12:.3f} TB/s", flush=True)
    rows, sweeps = ([], []) if args.skip_grid else grid(timer, bw, args.sweep)
    steps = decode_step(timer, bw, [1, 8, 32, 64])
    result = dict(device=torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (smoke)", commit=args.commit,
                  date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  torch=torch.__version__, triton=__import__("triton").__version__, dtype="bfloat16",
                  copy_bandwidth_Bps=round(bw), summary=summarize(rows, steps) if rows else {},
                  grid=rows, decode_step=steps, sweep=sweeps)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print_table(rows, sweeps)
    print(json.dumps(result["summary"], indent=1))


if __name__ == "__main__":
    main()
