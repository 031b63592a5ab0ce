"""The one-row float16-pairs kernels reading x ready-made (`kernels.quant_x_pairs`) against converting it themselves,
on the 8B's four projections at pick_config's one-row choice (the split's partials left to the next kernel, as the
engine runs them), 4 bits in groups of 128.

Each time is a CUDA graph of launches over weight copies beyond the L2 (`quant_kernel_sweep.graph_us`), the two
forms interleaved `--rounds` times; the outputs of the two forms are compared bit for bit (they take the same
float16 sums in the same order). A config whose launch does not read the form (`quant_matmul.reads_pairs`) is
skipped; LORAPLEX_X_PAIRS=all times the form on every one-row float16-pairs config (`--sweep`: the configs beside
pick_config's that decided that rule).

    python3 bench/x_pairs_ab.py --out bench/results/x_pairs_ab.json [--rounds 3]
    LORAPLEX_X_PAIRS=all python3 bench/x_pairs_ab.py --out sweep.json --sweep
    TRITON_INTERPRET=1 python3 bench/x_pairs_ab.py --smoke --out /tmp/s.json     # the CPU: checks only
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.quant_kernel_sweep import SHAPES_8B, graph_us, packed_copies, wall_us  # noqa: E402
from kernels.quant_matmul import (QuantMatmulConfig, launch_split, pick_config, quant_matmul,  # noqa: E402
                                  reads_pairs)
from kernels.quant_x_pairs import x_pairs  # noqa: E402

SMOKE_SHAPES = {"o": (64, 512), "gate_up": (256, 512)}
C = QuantMatmulConfig
SWEEP = {       # --sweep: one-row configs beside pick_config's, each in both forms
    "qkv": [C(64, 1, 4), C(64, 1, 8), C(64, 1, 16), C(128, 1, 4), C(128, 1, 16), C(128, 1, 8, tma_stages=2)],
    "o": [C(64, 1, 4), C(32, 1, 8), C(64, 1, 16)],
    "gate_up": [C(64, 1, 4), C(64, 1, 8), C(128, 1, 4), C(64, 1, 4, tma_stages=2), C(64, 1, 8, tma_stages=2),
                C(128, 1, 8, tma_stages=2)],
    "down": [C(64, 1, 4), C(64, 1, 16), C(128, 1, 8), C(64, 1, 8, tma_stages=2)],
}


def case(name: str, n: int, k: int, rounds: int, smoke: bool, cfg: QuantMatmulConfig | None = None) -> dict:
    dev = "cpu" if smoke else "cuda"
    gen = torch.Generator(device=dev).manual_seed(0)
    ws = packed_copies(n, k, 128, gen, span=1) if smoke else packed_copies(n, k, 128, gen)
    x = torch.randn(1, k, device=dev, generator=gen).to(torch.bfloat16)
    xp = x_pairs(x)
    picked = pick_config(1, n, k, 4, 4 if smoke else torch.cuda.get_device_properties(0).multi_processor_count, 128)
    cfg = cfg or picked
    if not reads_pairs(cfg, ws[0], x.dtype):
        print(f"{name}: {cfg} does not read x pairs (quant_matmul.reads_pairs)", flush=True)
        return {"projection": name, "n": n, "k": k, "config": repr(cfg), "picked": cfg == picked, "reads": False}
    split = launch_split(cfg, ws[0])
    out = torch.empty(1, n, device=dev, dtype=x.dtype)
    parts = [torch.empty(split * n, device=dev) for _ in range(2)]

    def fns(pairs):
        i = 1 if pairs is not None else 0
        return [lambda w=w: quant_matmul(x, w, None, out, cfg, parts[i], None, defer_split=split > 1, x_pairs=pairs)
                if split > 1 else quant_matmul(x, w, None, out, cfg, x_pairs=pairs) for w in ws]

    outs = []
    for pairs in (None, xp):
        quant_matmul(x, ws[0], None, out, cfg, parts[0], None, defer_split=split > 1, x_pairs=pairs)
        outs.append(parts[0].clone() if split > 1 else out.clone())
    same = torch.equal(outs[0], outs[1])
    timer = wall_us if smoke else graph_us
    plain, ready = [], []
    for _ in range(rounds):
        plain.append(timer(fns(None)))
        ready.append(timer(fns(xp)))
    row = {"projection": name, "n": n, "k": k, "config": repr(cfg), "picked": cfg == picked, "reads": True,
           "split": split, "bit_identical": same,
           "plain_us": plain, "ready_us": ready}
    print(f"{name}: {cfg} plain {min(plain):.2f} us, ready {min(ready):.2f} us, identical {same}", flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--sweep", action="store_true", help="also the SWEEP configs of each projection")
    args = ap.parse_args()
    shapes = SMOKE_SHAPES if args.smoke else SHAPES_8B
    rounds = 1 if args.smoke else args.rounds
    rows = [case(name, n, k, rounds, args.smoke) for name, (n, k) in shapes.items()]
    if args.sweep:
        rows += [case(name, n, k, rounds, args.smoke, cfg) for name, (n, k) in shapes.items()
                 for cfg in SWEEP[name][:1 if args.smoke else None]]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    device = "cpu (interpreter)" if args.smoke else torch.cuda.get_device_name(0)
    result = {"benchmark": "x_pairs_ab", "device": device, "commit": commit,
              "date": time.strftime("%Y-%m-%d %H:%M:%S"), "rows": rows}
    if not all(r["bit_identical"] for r in rows if r["reads"]):
        raise SystemExit(f"outputs differ between the two forms: {[r['projection'] for r in rows]}")
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
