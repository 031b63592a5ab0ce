"""Launch configurations of the shrink and expand kernels at 32-64 tokens a step, one launch kind at a time.

For each of a decode step's four LoRA launches (q/k/v, o, gate/up, down) and each kernel (shrink, expand),
this times the launch over all 32 layers of an 8B (one CUDA graph, L2 flushed before each replay; each token
its own adapter, 64 adapters resident) at the configuration `shrink_config` / `expand_config` choose and at
one-knob variations of it, for adapters of rank 16 in pools of largest rank 16, 64 and 256 and rank 64 in a
pool of 64. It is how the configurations for this range were picked (docs/kernels.md); the whole step's
effect is `bench/lora_rank_pad.py`'s.

Run on a CUDA GPU (bf16):
    python3 bench/lora_step_sweep.py --commit "$(git rev-parse --short HEAD)" --out /tmp/lora_step_sweep.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench.lora_kernels as lk  # noqa: E402
from kernels import LoraBatchMeta  # noqa: E402
from kernels.expand import expand_config, lora_expand_triton  # noqa: E402
from kernels.shrink import lora_shrink_triton, shrink_config  # noqa: E402

CASES = ((16, 16), (16, 64), (16, 256), (64, 64))     # (adapter rank, pool's largest rank)
SLOTS = 64
LAUNCH_NAMES = ("qkv", "o", "gate_up", "down")


def shrink_variants(base: dict) -> dict[str, dict]:
    """One-knob variations of a shrink configuration (absolute values: the wrapper recomputes the split)."""
    out = {"default": {}}
    for k in (64, 128, 256, 512):
        if k != base["BLOCK_K"]:
            out[f"BLOCK_K={k}"] = {"BLOCK_K": k}
    for w in (1, 2, 4, 8):
        if w != base["num_warps"]:
            out[f"warps={w}"] = {"num_warps": w}
    for f in (0.5, 2, 4):
        out[f"split*{f}"] = {"SPLIT_K": max(1, int(base["SPLIT_K"] * f))}
    for s in (2, 4):
        out[f"stages={s}"] = {"num_stages": s}
    for r in (16, 32):
        if r < base["BLOCK_R"]:
            out[f"BLOCK_R={r}"] = {"BLOCK_R": r}
            out[f"BLOCK_R={r},warps=2"] = {"BLOCK_R": r, "num_warps": 2}
    return out


def expand_variants(base: dict) -> dict[str, dict]:
    """One-knob variations of an expand configuration."""
    out = {"default": {}}
    for f in (8, 4, 2):
        g = base["GROUP_N"] // f
        if g >= base["BLOCK_N"] and g % base["BLOCK_N"] == 0:
            out[f"GROUP_N/{f}"] = {"GROUP_N": g}
    out["GROUP_N*2"] = {"GROUP_N": base["GROUP_N"] * 2}
    for n in (64, 256):
        if base["GROUP_N"] % n == 0:
            out[f"BLOCK_N={n}"] = {"BLOCK_N": n}
    for w in (2, 8):
        out[f"warps={w}"] = {"num_warps": w}
    for s in (1, 3, 4):
        out[f"stages={s}"] = {"num_stages": s}
    for r in (16, 32):
        if r < base["BLOCK_R"]:
            out[f"BLOCK_R={r}"] = {"BLOCK_R": r}
    out["BLOCK_M=32"] = {"BLOCK_M": 32}
    return out


# Combinations around the candidates the one-knob sweep found (--focused).
FOCUSED = {
    "shrink": {"default": {}, "BLOCK_K=128": {"BLOCK_K": 128}, "warps=2": {"num_warps": 2},
               "BLOCK_K=128,warps=2": {"BLOCK_K": 128, "num_warps": 2},
               "BLOCK_R=32,BLOCK_K=128,warps=2": {"BLOCK_R": 32, "BLOCK_K": 128, "num_warps": 2}},
    "expand": {"default": {}, "stages=1": {"num_stages": 1}, "BLOCK_R=16": {"BLOCK_R": 16},
               "BLOCK_R=32": {"BLOCK_R": 32}, "BLOCK_R=32,stages=1": {"BLOCK_R": 32, "num_stages": 1},
               "stages=1,BLOCK_N=256": {"num_stages": 1, "BLOCK_N": 256}, "stages=3": {"num_stages": 3}},
}


def parse_cases(text: str) -> tuple[tuple[int, int], ...]:
    """'16:64,64:64' -> ((16, 64), (64, 64)): adapter rank : pool's largest rank."""
    return tuple(tuple(int(v) for v in c.split(":")) for c in text.split(","))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU under TRITON_INTERPRET=1")
    ap.add_argument("--cases", type=parse_cases, default=CASES, help="rank:pool pairs, e.g. 16:64,64:64")
    ap.add_argument("--batches", default="32,64", help="tokens a step, e.g. 32,64")
    ap.add_argument("--focused", action="store_true", help="the combinations of FOCUSED instead of one-knob ones")
    args = ap.parse_args()
    global SLOTS
    batches = tuple(int(b) for b in args.batches.split(","))
    if args.smoke:
        lk.DEVICE, lk.HIDDEN, lk.KV, lk.INTER, lk.LAYERS, lk.PAGE_ELEMS = "cpu", 64, 32, 96, 1, 512
        lk.MODULES = {"q": (0, 64, 64), "k": (1, 64, 32), "v": (2, 64, 32), "o": (3, 64, 64),
                      "gate": (4, 64, 96), "down": (5, 96, 64), "up": (6, 64, 96)}
        SLOTS, batches = 4, (20,)
    dev = lk.DEVICE
    timer = lk.GraphTimer() if dev == "cuda" else lk.WallTimer()
    reps = {"reps": 10} if dev == "cuda" else {}
    rows = []
    for rank, max_rank in args.cases:
        pool, tables = lk.build_pool(SLOTS, lambda s, rank=rank: rank, lk.STEP_MODULES, lk.LAYERS, max_rank)
        for B in batches:
            meta = LoraBatchMeta(B, tables.max_slots, device=dev)
            meta.prepare((torch.arange(B) % SLOTS).to(torch.int32))
            bufs = lk.step_buffers(B, max_rank)
            for name, (mods, offs, x, s, y) in zip(LAUNCH_NAMES, bufs):
                widths = [b - a for a, b in zip(offs, offs[1:])]
                adapters = min(B, SLOTS)
                a_bytes = adapters * lk.LAYERS * rank * len(mods) * x.shape[1] * 2
                b_bytes = adapters * lk.LAYERS * rank * offs[-1] * 2
                kinds = (
                    ("shrink", FOCUSED["shrink"] if args.focused else
                     shrink_variants(shrink_config(B, x.shape[1], max_rank, len(mods), tables.max_slots, x.device)),
                     a_bytes,
                     lambda cfg: [lora_shrink_triton(x, pool, tables, meta, layer, mods, s, config=cfg,
                                                     out_zeroed=True) for layer in range(lk.LAYERS)]),
                    ("expand", FOCUSED["expand"] if args.focused else
                     expand_variants(expand_config(B, max_rank, widths, tables.max_slots, y.device)), b_bytes,
                     lambda cfg: [lora_expand_triton(s, pool, tables, meta, layer, mods, y, offs, config=cfg)
                                  for layer in range(lk.LAYERS)]),
                )
                for kind, variants, nbytes, run in kinds:
                    for label, cfg in variants.items():
                        try:
                            us = timer.us([lambda run=run, cfg=cfg: run(dict(cfg))], **reps)
                        except Exception as e:  # a variant the kernel cannot take: recorded, the rest go on
                            rows.append(dict(rank=rank, max_rank=max_rank, B=B, launch=name, kernel=kind,
                                             variant=label, error=repr(e)[:200]))
                            continue
                        row = dict(rank=rank, max_rank=max_rank, B=B, launch=name, kernel=kind, variant=label,
                                   us=round(us, 1), adapter_bytes=nbytes)
                        rows.append(row)
                        print(json.dumps(row), flush=True)
        del pool, tables
        if dev == "cuda":
            torch.cuda.empty_cache()
    out = dict(device=torch.cuda.get_device_name() if dev == "cuda" else "cpu (smoke)", commit=args.commit,
               date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               command=" ".join(sys.argv), rows=rows)
    args.out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
