"""Would a persistent decode step hide the 4-bit arithmetic under its loads? bench/quant_layer_probe.py measured the
structures with loads alone (the one-launch `preload_split` 30.1 µs a layer for the 8B's four projections, the
engine's chain of launches 32.3, the engine's kernels 41.4: docs/quantization-performance.md, "At the benchmark's
context"); this probe runs the same two structures with the one-row kernel's arithmetic on every unit of words
(`kernels.quant_gemv.h2_block`: float16 pairs, group scales and offsets read from memory; a program a contiguous
range of a phase's units, a tile's sums added to the output atomically) and without it, over 32 layers of the 8B's
packed 4-bit q/k/v, o, gate/up and down:

  chain       one launch a projection (programmatic dependent launches), each program reading its first unit
              before its wait where `early_units` is 1 (the layer probe's `launches_early`);
  persistent  one launch for the step, a grid barrier between projections, each program requesting its first
              unit of the next projection between arriving and waiting (`preload_split`).

So `persistent` with the arithmetic, against the chain with it, says what the persistent structure gains on the
projections once the arithmetic runs (measured: docs/quantization-performance.md, "The persistent step with the
arithmetic, probed"; the chain here is above the engine's own kernels, whose per-projection configurations it
does not reproduce). No small phases (norms, attention): their cost in each structure is the layer probe's. The
kernels are in bench/quant_step_arith_kernels.py.

    python3 bench/quant_step_arith.py --commit "$(git rev-parse --short HEAD)" --out bench/results/quant_step_arith.json
    TRITON_INTERPRET=1 python3 bench/quant_step_arith.py --smoke --out /tmp/a.json   # CPU: tiny shapes, checked
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from quant_kernel_sweep import SHAPES_8B, graph_us  # noqa: E402
from quant_step_arith_kernels import layers, one_phase  # noqa: E402
from run_header import gpu_run_header  # noqa: E402
from kernels.pdl import launch_args  # noqa: E402
from kernels.quant_dequant import dequantize_packed  # noqa: E402
from kernels.quant_pack import PackedQuantWeight  # noqa: E402
from scripts.kernel_sass import not_resident  # noqa: E402

MODES = ("chain", "persistent")


class Step:
    """32 layers (and a spare, for the last early reads) of the four projections' words, their scales and offsets
    (an eighth of the words, as float16), and x."""

    def __init__(self, dev: torch.device, layers_: int, smoke: bool):
        self.dev, self.layers = dev, layers_
        self.shapes = ([(64, 64), (32, 64), (64, 32), (32, 96)] if smoke
                       else [(n, k // 8) for n, k in SHAPES_8B.values()])           # [N, W] in words
        self.starts = [0]
        for n, w in self.shapes[:-1]:
            self.starts.append(self.starts[-1] + n * w)
        self.layer_words = sum(n * w for n, w in self.shapes)
        gen = torch.Generator(device=dev).manual_seed(0)
        # randn floats seen as words: loads-alone sums stay finite; any words are codes to the arithmetic
        self.w = torch.randn((layers_ + 1) * self.layer_words, device=dev, generator=gen).view(torch.int32)
        self.s = (torch.rand((layers_ + 1) * self.layer_words // 8, device=dev, generator=gen) * 0.002
                  + 1e-4).half()
        self.x = torch.randn(max(w for _, w in self.shapes) * 8, device=dev, generator=gen).to(torch.bfloat16)
        self.bar = torch.zeros(3, dtype=torch.int32, device=dev)
        self.asm = dev.type == "cuda"

    def geometry(self) -> list[int]:
        return [v for s in self.shapes for v in s] + self.starts[1:] + [self.layer_words]

    def persistent_args(self, arith: bool, programs: int, bn: int, warps: int, pre: int,
                        out: torch.Tensor) -> tuple[list, dict]:
        """The persistent kernel's arguments: the same ones run and checked for residency (one compiled program)."""
        return ([self.w, self.x, self.s, out, self.bar, programs, self.layers, *self.geometry()],
                dict(BN=bn, PRE=pre, ARITH=arith, ASM=self.asm, BARRIER=self.asm, NT=warps * 32, num_warps=warps))

    def launches(self, mode: str, arith: bool, programs: int, bn: int, warps: int, pre: int,
                 out: torch.Tensor) -> list:
        if mode == "persistent":
            args, kw = self.persistent_args(arith, programs, bn, warps, pre, out)

            def run() -> None:
                self.bar[0].zero_()
                layers[(programs,)](*args, **kw)
            return [run]
        kw = dict(BN=bn, PRE=pre, ARITH=arith, ASM=self.asm, num_warps=warps)
        pdl = launch_args(self.dev.type == "cuda")
        fns = []
        for layer in range(self.layers):
            for (n, w), at in zip(self.shapes, self.starts):
                wl = layer * self.layer_words + at
                fns.append(lambda wl=wl, n=n, w=w: one_phase[(programs,)](self.w[wl:], self.x, self.s[wl // 8:], out,
                                                                         programs, n, w, **kw, **pdl))
        return fns

    def resident(self, arith: bool, programs: int, per_sm: int, bn: int, warps: int, pre: int,
                 out: torch.Tensor) -> str | None:
        """Why the persistent grid could not be resident at once (its barriers would never open), or None."""
        args, kw = self.persistent_args(arith, programs, bn, warps, pre, out)
        k = layers.warmup(*args, **kw, grid=(programs,))
        major, minor = torch.cuda.get_device_capability(self.dev)
        return not_resident(k, warps, 10 * major + minor, per_sm)

    def reference(self) -> torch.Tensor:
        """out's sums with the arithmetic: every layer's four products of x, added by row (fp32)."""
        want = torch.zeros(max(n for n, _ in self.shapes), device=self.dev)
        for layer in range(self.layers):
            for (n, w), at in zip(self.shapes, self.starts):
                o = layer * self.layer_words + at
                s = self.s[o // 8:o // 8 + n * w // 8].view(2, w // 16, n)
                p = PackedQuantWeight(self.w[o:o + n * w].view(n, w), s[0], s[1], 4, 128, w * 8)
                dense = torch.empty(n, w * 8, device=self.dev)
                dequantize_packed(p, dense)
                want[:n] += dense @ self.x[:w * 8].float()
        return want

    def check(self, arith: bool, out: torch.Tensor, want: torch.Tensor) -> float:
        """The arithmetic: the sums' relative error against the reference. Loads alone: the words' sum read against
        their own sum, over its tolerance (1e-3 relative plus 1: < 1 when every word was read once)."""
        if arith:
            return ((out - want).norm() / want.norm()).item()
        total = self.w[:self.layers * self.layer_words].view(torch.float32).double().sum().item()
        return abs(out.double().sum().item() - total) / (1e-3 * abs(total) + 1.0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--commit", default="")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, 2 layers, the CPU interpreter; no figures")
    ap.add_argument("--configs", default="", help="semicolon-separated per_sm,block_n,warps,early_units (0 or 1)")
    args = ap.parse_args()
    dev = torch.device("cpu" if args.smoke else "cuda")
    nlayers = 2 if args.smoke else 32
    step = Step(dev, nlayers, args.smoke)
    sms = 2 if args.smoke else torch.cuda.get_device_properties(dev).multi_processor_count
    res = ({"device": "cpu", "commit": args.commit} if args.smoke else gpu_run_header(dev, args.commit))
    res.update(layers=nlayers, cases=[])
    configs = [(1, 32, 4, 1), (1, 32, 4, 0)] if args.smoke else [
        (4, 64, 4, 1), (4, 64, 4, 0), (3, 64, 4, 1), (2, 64, 8, 1), (2, 128, 4, 1), (2, 128, 8, 1), (4, 64, 8, 1),
        (1, 128, 8, 1)]
    if args.configs:
        configs = [tuple(int(v) for v in c.split(",")) for c in args.configs.split(";")]
    want = step.reference()
    for per_sm, bn, warps, pre in configs:
        programs = sms * per_sm
        for arith in (False, True):
            for mode in MODES:
                case = dict(mode=mode, arith=arith, programs_per_sm=per_sm, block_n=bn, warps=warps, early_units=pre)
                out = torch.zeros(want.numel(), device=dev)
                why = (step.resident(arith, programs, per_sm, bn, warps, pre, out)
                       if mode == "persistent" and not args.smoke else None)
                if why:
                    res["cases"].append(dict(case, skipped=why))
                    print(case, "skipped:", why, flush=True)
                    continue
                fns = step.launches(mode, arith, programs, bn, warps, pre, out)
                try:
                    for f in fns:
                        f()
                except Exception as e:  # noqa: BLE001  a config the compiler refuses: recorded, skipped
                    res["cases"].append(dict(case, skipped=repr(e)[:300]))
                    print(case, "failed:", repr(e)[:300], flush=True)
                    continue
                err = step.check(arith, out, want)
                gave_up = bool(step.bar[1].item())
                step.bar[1].zero_()
                us = 0.0 if args.smoke else graph_us(fns) * len(fns)
                row = dict(case, us=us, us_per_layer=us / nlayers, err=err, barrier_gave_up=gave_up)
                res["cases"].append(row)
                print(" ".join(f"{k}={v}" for k, v in case.items()), f"{us / nlayers:.2f} us a layer, err {err:.1e}"
                      + (" (a barrier gave up)" if gave_up else ""), flush=True)
        args.out.write_text(json.dumps(res, indent=1))
    bad = [c for c in res["cases"] if "err" in c and not c["err"] < (1e-2 if c["arith"] else 1.0)]
    if bad:
        raise SystemExit(f"wrong sums: {bad}")


if __name__ == "__main__":
    main()
