"""LoRA time of a whole decode step against the adapter pool's largest rank (`--max-lora-rank`).

The pool accepts adapters up to its largest rank (256 by default); the launch configuration may depend only
on host-known shapes (CUDA graphs), so it is chosen from that largest rank, not from the ranks a step
serves. This times the LoRA launches of one decode step of an 8B (7 modules x 32 layers, each token its own
adapter, 64 adapters resident) for adapters of rank 16 and 64 in pools of largest rank 16, 64 and 256: the
fused launch at up to 16 tokens, shrink + expand above (what the engine runs). Each figure is the median of
CUDA-graph replays with L2 flushed before each (bench/lora_kernels.py's timer).

Run on a CUDA GPU (bf16):
    python3 bench/lora_rank_pad.py --commit "$(git rev-parse --short HEAD)" --out bench/results/lora_rank_pad.json
`KERNELS_ROOT=DIR` times the kernels of another checkout's `DIR/kernels` (an A/B on one lease); `--label`
names the run in the JSON, and `--merge FILE` adds this run's rows to FILE's.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
if os.environ.get("KERNELS_ROOT"):
    sys.path.insert(0, os.environ["KERNELS_ROOT"])
import kernels  # noqa: E402,F401  (first, so that bench.lora_kernels's own path insert keeps this copy)
import bench.lora_kernels as lk  # noqa: E402
from kernels import LoraBatchMeta  # noqa: E402
from kernels.expand import lora_expand_triton  # noqa: E402
from kernels.fused import FUSED_MAX_TOKENS, fused_workspace, lora_fused_triton  # noqa: E402
from kernels.shrink import lora_shrink_triton  # noqa: E402

CASES = ((16, 16), (16, 64), (16, 256), (64, 64), (64, 256))     # (adapter rank, pool's largest rank)
BATCHES = (1, 8, 32, 64)
SLOTS = 64


def step_us(timer, pool, tables, max_rank: int, B: int) -> float:
    dev = lk.DEVICE
    meta = LoraBatchMeta(B, tables.max_slots, device=dev)
    meta.prepare((torch.arange(B) % SLOTS).to(torch.int32))
    ws = fused_workspace(B, max_rank, dev)
    bufs = lk.step_buffers(B, max_rank)

    def step():
        for layer in range(lk.LAYERS):
            for mods, offs, x, s, y in bufs:
                if B <= FUSED_MAX_TOKENS:
                    lora_fused_triton(x, pool, tables, meta, layer, mods, y, offs, ws)
                else:
                    lora_shrink_triton(x, pool, tables, meta, layer, mods, s)
                    lora_expand_triton(s, pool, tables, meta, layer, mods, y, offs)

    return timer.us([step], reps=10) if dev == "cuda" else timer.us([step])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--label", default="tree", help="name of this run's kernels in the JSON")
    ap.add_argument("--merge", type=Path, help="a JSON of an earlier run whose rows to keep beside these")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny shapes on CPU under TRITON_INTERPRET=1 (checks the script)")
    args = ap.parse_args()
    global SLOTS, BATCHES
    if args.smoke:
        lk.DEVICE, lk.HIDDEN, lk.KV, lk.INTER, lk.LAYERS, lk.PAGE_ELEMS = "cpu", 64, 32, 96, 1, 512
        lk.MODULES = {"q": (0, 64, 64), "k": (1, 64, 32), "v": (2, 64, 32), "o": (3, 64, 64),
                      "gate": (4, 64, 96), "down": (5, 96, 64), "up": (6, 64, 96)}
        SLOTS, BATCHES = 4, (1, 20)
    timer = lk.GraphTimer() if lk.DEVICE == "cuda" else lk.WallTimer()
    rows = []
    for rank, max_rank in CASES:
        pool, tables = lk.build_pool(SLOTS, lambda s, rank=rank: rank, lk.STEP_MODULES, lk.LAYERS, max_rank)
        per_adapter = lk.LAYERS * rank * 2 * sum(len(mods) * fin + sum(outs) for mods, fin, outs in lk.step_launches())
        for B in BATCHES:
            us = step_us(timer, pool, tables, max_rank, B)
            row = dict(kernels=args.label, rank=rank, max_rank=max_rank, B=B, us=round(us, 1),
                       path="fused" if B <= FUSED_MAX_TOKENS else "shrink+expand",
                       adapter_bytes=min(B, SLOTS) * per_adapter)
            print(json.dumps(row), flush=True)
            rows.append(row)
        del pool, tables
        if lk.DEVICE == "cuda":
            torch.cuda.empty_cache()
    out = dict(device=torch.cuda.get_device_name() if lk.DEVICE == "cuda" else "cpu (smoke)", commit=args.commit,
               date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               command=" ".join(sys.argv), rows=rows)
    if args.merge and args.merge.exists():
        out["rows"] = json.loads(args.merge.read_text())["rows"] + rows
    args.out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
