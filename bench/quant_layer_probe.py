"""Whether one persistent launch a decode step could stream a 4-bit 8B's weights faster than a chain of launches.

Issue 16's batch-1 goals leave ~40 us a layer; the engine takes ~53 (docs/quantization-performance.md, "The batch-1
goals"). The one way left on paper is a persistent kernel: every program stays resident for the whole
step, the phases of a layer are separated by grid barriers instead of launch boundaries, and programs that have
nothing to do in a phase (a norm runs on one program, the attention on eight) read the next projection's first
words meanwhile. This probe measures that structure before anyone builds it, with loads and no arithmetic (the
words summed as floats, as in bench/quant_gemv_probe.py), over 32 layers of the 8B's packed 4-bit words
(q/k/v, o, gate/up, down):

  launches      one launch a phase, P programs each (P = SMs x programs an SM), programmatic dependent launches
                that wait, then read (the engine's chain, with the same reads);
  launches_early  the same, each launch reading its first `early_units` units of words before its wait;
  persistent    one launch of P programs for the step; a grid barrier (an atomic counter) between phases;
  preload       that, each program requesting its first units of the next projection before it arrives at the
                barrier (at the barrier before a small phase, so that the reads span it);
  preload_split the same requested after arriving and before waiting (an arrival releases: loads requested
                before it are completed first);
  stream        one launch, no barriers: the ceiling of the structure (what the word reads cost alone);
  barriers      the barriers (and small phases) alone, no words;
  pipelined     one launch whose streaming programs (one an SM) run a single loop over all their units of the
                step, software-pipelined `depth` - 1 units ahead through shared memory, so that the next phase's
                words are in flight across the barrier; the small phases run on programs of their own. Its units
                are read as contiguous blocks (unit u of a weight at u times a unit's words), addressed with no
                division.

Each runs without and with "small" phases, three a layer where few programs work (a norm: one program reads
8 KB; the attention: eight programs read 256 KB each, 512 tokens of a KV head, or `--attn-words` words; the
second norm), as in a real layer. Within a phase a program takes every P-th unit ([block_n rows, 32 words]),
`depth` units a load. The kernels are in bench/quant_layer_probe_kernels.py.

`--per-projection` instead times each projection's loads alone after a one-program norm launch, per layer (the
engine trace's "from its x" figure, bench/step_profile.py); with `--engine-grids` also on pick_config's one-row
grids (a program a [block_n, K / split] tile).

    python3 bench/quant_layer_probe.py --commit "$(git rev-parse --short HEAD)" \
        --out bench/results/quant_layer_probe.json
    python3 bench/quant_layer_probe.py --attn-words 12288 --per-projection --engine-grids \
        --configs "4,64,2,8,0,2" --out per_projection.json   # the benchmark's ~96-token context
    TRITON_INTERPRET=1 python3 bench/quant_layer_probe.py --smoke --out /tmp/p.json   # the script on CPU, no barriers
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from multi_lora import copy_bandwidth  # noqa: E402  (bench helpers)
from quant_kernel_sweep import SHAPES_8B, graph_us  # noqa: E402
from kernels.pdl import launch_args  # noqa: E402
from scripts.kernel_sass import not_resident  # noqa: E402
from quant_layer_probe_kernels import (ATTN_PROGRAMS, ATTN_WORDS, NORM_WORDS, _layers, _layers_flat,  # noqa: E402
                                       _one_phase, _one_small, _one_tile)

MODES = ("launches", "launches_early", "persistent", "preload", "preload_split", "stream", "barriers", "pipelined")
PERSISTENT = ("persistent", "preload", "preload_split", "barriers", "pipelined")


def shapes(smoke: bool) -> list[tuple[int, int]]:
    """[N, W] (rows, int32 words a row) of q/k/v, o, gate/up, down."""
    if smoke:
        return [(128, 192), (64, 128), (256, 64), (64, 256)]
    return [(n, k // 8) for n, k in SHAPES_8B.values()]


def small_sizes(smoke: bool, attn_words: int) -> tuple[int, int, int]:
    return (1024, 2, 2048) if smoke else (NORM_WORDS, ATTN_PROGRAMS, attn_words)


class Step:
    """One step's buffers and its launches for a mode and config."""

    def __init__(self, dev: torch.device, layers: int, smoke: bool, attn_words: int = ATTN_WORDS):
        self.dev, self.layers, self.smoke = dev, layers, smoke
        self.shapes = shapes(smoke)
        self.layer_words = sum(n * w for n, w in self.shapes)
        self.norm_w, self.attn_p, self.attn_w = small_sizes(smoke, attn_words)
        self.kv_words = 2 * self.norm_w + self.attn_p * self.attn_w
        # randn floats seen as words: the sums stay finite; one spare layer for the last preload
        self.w = torch.randn((layers + 1) * self.layer_words, device=dev).view(torch.int32)
        self.kv = torch.randn(layers * self.kv_words, device=dev)
        self.bar = torch.zeros(3, dtype=torch.int32, device=dev)    # counts, gave up, small programs' count
        # what a full read sums to (`check`), once: every case reads the same buffers
        self.words_sum = self.w[:layers * self.layer_words].view(torch.float32).double().sum()
        self.kv_sum = self.kv.double().sum()

    def starts(self) -> list[int]:
        """Where each weight starts in a layer's words."""
        starts = [0]
        for n, w in self.shapes[:-1]:
            starts.append(starts[-1] + n * w)
        return starts

    def geometry(self) -> list[int]:
        """The layer kernels' shape arguments: [N, W] of each weight, where each starts in a layer (but the
        first), a layer's words, a layer's words of small-phase data."""
        return [v for s in self.shapes for v in s] + self.starts()[1:] + [self.layer_words, self.kv_words]

    def weight_bytes(self) -> int:
        return self.layers * self.layer_words * 4

    def layers_kw(self, mode: str, small: bool, bn: int, depth: int, warps: int, poll: int, pre: int) -> dict:
        """The persistent kernel's constexprs for a mode (barriers: the barriers and small phases, no words)."""
        return dict(BN=bn, D=depth, BARRIER=mode != "stream" and self.dev.type == "cuda",
                    PRE=pre if mode.startswith("preload") else 0, SPLIT=mode == "preload_split", SMALL=small,
                    NORM_W=self.norm_w, ATTN_P=self.attn_p, ATTN_W=self.attn_w, POLL=poll,
                    READ=int(mode != "barriers"), NT=warps * 32, num_warps=warps)

    def flat_kw(self, small: bool, bn: int, stages: int, warps: int) -> dict:
        """`_layers_flat`'s constexprs (`stages` in the configs' depth column)."""
        return dict(BN=bn, STAGES=stages, BARRIER=self.dev.type == "cuda", SMALL=small, NORM_W=self.norm_w,
                    ATTN_P=self.attn_p, ATTN_W=self.attn_w, NT=warps * 32, num_warps=warps)

    def launches(self, mode: str, small: bool, programs: int, bn: int, depth: int, warps: int, poll: int,
                 pre: int, out: torch.Tensor, tot: torch.Tensor) -> list:
        """The step as callables, in order."""
        pdl = launch_args(self.dev.type == "cuda")
        if mode == "pipelined":
            flat = self.geometry()
            kw = self.flat_kw(small, bn, depth, warps)

            def run_flat() -> None:
                self.bar[0::2].zero_()
                _layers_flat[(programs + (self.attn_p if small else 0),)](self.w, self.kv, out, tot, self.bar,
                                                                           programs, self.layers, *flat, **kw)
            return [run_flat]
        if mode not in ("launches", "launches_early"):
            flat = self.geometry()
            kw = self.layers_kw(mode, small, bn, depth, warps, poll, pre)

            def run() -> None:
                self.bar[0].zero_()
                _layers[(programs,)](self.w, self.kv, out, tot, self.bar, programs, self.layers, *flat, **kw)
            return [run]
        fns = []
        offs = self.starts()
        for layer in range(self.layers):
            wl, kvl = layer * self.layer_words, layer * self.kv_words

            def proj(i: int, wl=wl) -> None:
                n, w = self.shapes[i]
                _one_phase[(programs,)](self.w[wl + offs[i]:], out, programs, n, w, BN=bn, D=depth,
                                        PRE=pre if mode == "launches_early" else 0, num_warps=warps, **pdl)

            def norm(at: int) -> None:
                _one_small[(1,)](self.kv[at:], tot, 1, self.norm_w, num_warps=4, **pdl)

            def attn(kvl=kvl) -> None:
                _one_small[(self.attn_p,)](self.kv[kvl + self.norm_w:], tot, self.attn_p, self.attn_w,
                                           num_warps=4, **pdl)
            at2 = kvl + self.norm_w + self.attn_p * self.attn_w
            fns += ([lambda kvl=kvl: norm(kvl)] if small else []) + [lambda p=proj: p(0)] + ([attn] if small else [])
            fns += [lambda p=proj: p(1)] + ([lambda a=at2: norm(a)] if small else [])
            fns += [lambda p=proj: p(2), lambda p=proj: p(3)]
        return fns

    def check(self, out: torch.Tensor, tot: torch.Tensor, small: bool, words: bool) -> None:
        """Every word (where read) and (with the small phases) every KV value was read once."""
        want, got = self.words_sum, out.double().sum()
        assert not words or torch.allclose(got, want, rtol=1e-3, atol=1.0), f"words read wrong: {got} against {want}"
        if small:
            want, got = self.kv_sum, tot.double().sum()
            assert torch.allclose(got, want, rtol=1e-3, atol=1.0), f"KV read wrong: {got} against {want}"


def fits(step: Step, mode: str, small: bool, programs: int, bn: int, depth: int, warps: int, poll: int, pre: int,
         out: torch.Tensor, tot: torch.Tensor) -> str | None:
    """Why the persistent grid might not be resident at once (the barrier would then never open), or None. The
    kernel is compiled with the launch's own arguments (Triton specializes on integers equal to 1, so a stand-in
    program count would compile another kernel)."""
    flat = step.geometry()
    programs_per_sm = programs // torch.cuda.get_device_properties(step.dev).multi_processor_count
    if mode == "pipelined":            # a small-phase program may share an SM with a streaming one
        programs_per_sm += int(small)
        grid = (programs + (step.attn_p if small else 0),)
        k = _layers_flat.warmup(step.w, step.kv, out, tot, step.bar, programs, step.layers, *flat,
                                **step.flat_kw(small, bn, depth, warps), grid=grid)
    else:
        k = _layers.warmup(step.w, step.kv, out, tot, step.bar, programs, step.layers, *flat,
                           **step.layers_kw(mode, small, bn, depth, warps, poll, pre), grid=(programs,))
    major, minor = torch.cuda.get_device_capability(step.dev)
    return not_resident(k, warps, 10 * major + minor, programs_per_sm)


def replay_us(dev: torch.device, fns: list) -> float:
    """µs of one replay of `fns` captured as one CUDA graph (`quant_kernel_sweep.graph_us`, which runs them once
    first and gives the time a call); on the CPU they run once and take 0."""
    if dev.type != "cuda":
        for f in fns:
            f()
        return 0.0
    return graph_us(fns) * len(fns)


def per_projection(step: Step, programs: int, bn: int, depth: int, warps: int, pre: int, out: torch.Tensor,
                   tot: torch.Tensor, grids: dict | None = None) -> dict:
    """Each projection's loads alone in a chain like the engine's, µs a layer: per layer a one-program norm launch
    (8 KB) then the projection's launch (its first `pre` units read before its wait), less the norms alone, so
    each figure is the projection's time from the end of the launch that writes its x (the engine trace's
    `from_x_us`, bench/step_profile.py). `grids` ({name: (block_n, split, warps)}): those projections read as the
    engine's one-row kernels take them (`_one_tile`, its first `pre` blocks before the wait) instead."""
    pdl = launch_args(step.dev.type == "cuda")
    offs = step.starts()

    def norm(layer: int):
        at = layer * step.kv_words
        return lambda: _one_small[(1,)](step.kv[at:], tot, 1, step.norm_w, num_warps=4, **pdl)

    def proj(layer: int, i: int):
        (n, w), at = step.shapes[i], layer * step.layer_words + offs[i]
        name = list(SHAPES_8B)[i]
        if grids and name in grids:
            gbn, split, gwarps = grids[name]
            return lambda: _one_tile[(n // gbn, split)](step.w[at:], out, n, w, BN=gbn, SPLIT=split, PRE=pre,
                                                        num_warps=gwarps, **pdl)
        return lambda: _one_phase[(programs,)](step.w[at:], out, programs, n, w, BN=bn, D=depth, PRE=pre,
                                               num_warps=warps, **pdl)

    def read_all(i: int) -> None:
        """Every word of projection i, in every layer, read once (the launches' sums against the words')."""
        (n, w), words = step.shapes[i], step.w[:step.layers * step.layer_words].view(step.layers, -1)
        want = words[:, offs[i]:offs[i] + n * w].view(torch.float32).double().sum()
        out.zero_()
        for layer in range(step.layers):
            proj(layer, i)()
        got = out.double().sum()
        assert torch.allclose(got, want, rtol=1e-3, atol=1.0), f"{list(SHAPES_8B)[i]}: read {got}, words {want}"

    norms = replay_us(step.dev, [norm(layer) for layer in range(step.layers)])
    res = {"norms_us": norms / step.layers}
    for i, name in enumerate(SHAPES_8B):
        read_all(i)
        fns = [f for layer in range(step.layers) for f in (norm(layer), proj(layer, i))]
        res[name] = (replay_us(step.dev, fns) - norms) / step.layers
    return res


def engine_grids(step: Step, sms: int) -> dict:
    """{name: (block_n, split, warps)}: pick_config's one-row choice for each 8B shape (the smoke run's shapes are
    smaller; their grids are scaled to fit)."""
    from kernels.quant_matmul import pick_config

    grids = {}
    for (name, (n, k)), (sn, sw) in zip(SHAPES_8B.items(), step.shapes):
        cfg = pick_config(1, n, k, 4, sms, 128)
        grids[name] = (min(cfg.block_n, sn), max(1, min(cfg.split_k, sw // 32)), cfg.num_warps)
    return grids


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--commit", default="")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (TRITON_INTERPRET=1), no barriers")
    ap.add_argument("--attn-words", type=int, default=ATTN_WORDS,
                    help="words each attention program reads a layer (a multiple of 1024; default %(default)s, a KV "
                         "head's 512 tokens; 12288 is ~96 tokens, the engine benchmark's mean context)")
    ap.add_argument("--modes", default=",".join(MODES), help="which of " + ", ".join(MODES))
    ap.add_argument("--per-projection", action="store_true",
                    help="instead of the modes: each projection's loads alone after a norm, µs a layer "
                         "(per_projection)")
    ap.add_argument("--engine-grids", action="store_true",
                    help="with --per-projection: also each projection read on pick_config's one-row grid (block_n, "
                         "split, warps), loads only")
    ap.add_argument("--configs", default="", help="semicolon-separated per_sm,block_n,depth,warps,poll,early_units "
                    "(pipelined: depth is the stages)")
    args = ap.parse_args()
    dev = torch.device("cpu" if args.smoke else "cuda")
    layers = 2 if args.smoke else args.layers
    step = Step(dev, layers, args.smoke, args.attn_words)
    sms = 4 if args.smoke else torch.cuda.get_device_properties(dev).multi_processor_count
    bw = None if args.smoke else copy_bandwidth(dev, 2**31)
    res: dict = {"device": "cpu" if args.smoke else torch.cuda.get_device_name(dev), "commit": args.commit,
                 "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                 "layers": layers, "sms": sms, "copy_bandwidth_Bps": bw, "weight_bytes": step.weight_bytes(),
                 "floor_us_per_layer": step.weight_bytes() / bw * 1e6 / layers if bw else None,
                 "small_phases": dict(norm_words=step.norm_w, attn_programs=step.attn_p, attn_words=step.attn_w),
                 "cases": []}
    # (programs an SM, block_n, units a load, warps, how waits poll, units read early)
    configs = [(1, 32, 2, 4, 0, 2)] if args.smoke else [
        (4, 64, 2, 8, 0, 2), (2, 64, 2, 8, 0, 4), (2, 64, 2, 8, 0, 8), (1, 128, 4, 16, 0, 4),
        (1, 128, 4, 16, 0, 8), (1, 128, 4, 16, 2, 8), (1, 128, 4, 32, 0, 8)]
    if args.configs:
        configs = [tuple(int(v) for v in c.split(",")) for c in args.configs.split(";")]
    if args.per_projection:
        res["per_projection"] = []
        for per_sm, bn, depth, warps, _, pre in configs:
            out = torch.zeros(max(sms * per_sm * bn, max(n for n, _ in step.shapes)), device=dev)   # `_one_tile`: a row
            tot = torch.zeros(1, device=dev)
            row = dict(programs_per_sm=per_sm, block_n=bn, depth=depth, warps=warps, early_units=pre,
                       **per_projection(step, sms * per_sm, bn, depth, warps, pre, out, tot))
            rows = [row]
            if args.engine_grids:
                grids = engine_grids(step, sms)
                rows.append(dict(grids={k: list(v) for k, v in grids.items()}, early_units=pre,
                                 **per_projection(step, sms * per_sm, bn, depth, warps, pre, out, tot, grids)))
            for row in rows:
                res["per_projection"].append(row)
                print(" ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()),
                      flush=True)
        args.out.write_text(json.dumps(res, indent=1))
        return
    for per_sm, bn, depth, warps, poll, pre in configs:
        programs = sms * per_sm
        for small in (False, True):
            for mode in args.modes.split(","):
                case = dict(mode=mode, small=small, programs_per_sm=per_sm, block_n=bn, depth=depth, warps=warps,
                            poll=poll, early_units=pre)
                if poll and mode not in PERSISTENT:       # the same launches as the config with poll 0
                    continue
                extra = step.attn_p if mode == "pipelined" and small else 0      # the small phases' programs
                out = torch.zeros((programs + extra) * bn, device=dev)
                tot = torch.zeros(programs + extra, device=dev)
                why = None if args.smoke or mode not in PERSISTENT else fits(step, mode, small, programs, bn, depth,
                                                                             warps, poll, pre, out, tot)
                if why:
                    res["cases"].append(dict(case, skipped=why))
                    print(case, "skipped:", why, flush=True)
                    continue
                fns = step.launches(mode, small, programs, bn, depth, warps, poll, pre, out, tot)
                for f in fns:
                    f()
                step.check(out, tot, small, words=mode != "barriers")
                us = 0.0
                if not args.smoke and step.bar[1].item():
                    res["cases"].append(dict(case, skipped="a barrier gave up: the grid was not resident at once"))
                    print(case, "skipped: a barrier gave up", flush=True)
                    step.bar[1].zero_()
                    continue
                if not args.smoke:
                    us = replay_us(dev, fns)
                row = dict(case, us=us, us_per_layer=us / layers, barrier_gave_up=bool(step.bar[1].item()))
                res["cases"].append(row)
                print(" ".join(f"{k}={v}" for k, v in case.items()), f"{us / layers:.2f} us a layer", flush=True)
        args.out.write_text(json.dumps(res, indent=1))        # after each config: a run cut short keeps its cases


if __name__ == "__main__":
    main()
