"""Where the 4-bit kernels' warps wait: the GPU profiler's stall reasons for `quant_gemv_kernel` (one token) or
the tensor-core tiles (`--rows` 2-64; with `--async-dots`, 1-32 rows: the asynchronous-dot kernel,
`kernels.quant_wgmma`, where pick_config takes it) on the 8B's projections, and the machine-code lines the
samples land on,
each hot line with the global or local load it waits for and how many instructions earlier that load was issued
(across a loop's back edge).

    python3 bench/quant_gemv_stalls.py --out bench/results/quant_gemv_stalls.json [--shapes gate_up,down] [--rows 8]
        [--async-dots]
    python3 bench/quant_gemv_stalls.py --parse RAW_DIR --out ...     # again from the profiler's saved output

Needs the profiler command line (`ncu`, in the CUDA toolkit's bin) and a GPU; its raw output lands beside the
JSON (`<out stem>_raw/`, or --raw). Each projection runs as its own process (`--launch NAME`: packed random weights,
pick_config's choice, a few launches; the profiler keeps the fifth), at the card's own clocks. The profiler
samples a warp's state every few cycles: "selected" is a warp issuing, "long_scoreboard" one waiting for a
global or local (spilled) load, "barrier" one at a block-wide barrier, "wait" a fixed-latency dependency.
"""
from __future__ import annotations

import argparse
import csv
import io
import json
import re
import shutil
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripts.kernel_sass import loops as _code_loops  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
# pick_config on these shapes: the one-row kernel for one row (gate/up: its TMA-read form), the tiles for 2-64
KERNELS = {True: "regex:quant_gemv(_tma)?_kernel", False: "regex:quant_mma_kernel"}    # one row: either form
ASYNC_KERNELS = "regex:quant_(wgmma|gemv(_tma)?)_kernel"   # with async dots: the ring kernel (or one row's kernel)
STALL_METRICS = r"regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio"
OTHER_METRICS = ("gpu__time_duration.sum", "smsp__inst_executed.sum", "sm__cycles_active.avg",
                 "smsp__issue_active.avg.per_cycle_active", "smsp__warps_active.avg.per_cycle_active",
                 "launch__registers_per_thread", "launch__grid_size")
REG = re.compile(r"\bR(\d+)\b")
WIDTH = {"128": 4, "64": 2}


def launch(name: str, rows: int = 1, async_dots: bool = False) -> None:
    """Six launches of pick_config's choice for `rows` rows on projection `name` (random 4-bit weights, groups of
    128), given `async_dots`."""
    import torch

    from kernels.quant_matmul import pick_config, quant_matmul
    from kernels.quant_pack import pack_quantized
    n, k = SHAPES[name]
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, device=dev, generator=gen)
    s = (torch.rand(n, k // 128, device=dev, generator=gen) * 0.002 + 1e-4).half()
    w = pack_quantized(q, s, (-8 * s.float()).half(), 4, 128)
    x = torch.randn(rows, k, device=dev, generator=gen).to(torch.bfloat16)
    cfg = pick_config(rows, n, k, 4, torch.cuda.get_device_properties(dev).multi_processor_count, 128,
                      async_dots=async_dots)
    print(cfg, flush=True)
    out = torch.empty(rows, n, device=dev, dtype=torch.bfloat16)
    part = torch.empty(cfg.split_k * rows * n, device=dev)
    locks = torch.zeros(65536, dtype=torch.int32, device=dev)     # split-K counters, one per output tile
    for _ in range(6):
        quant_matmul(x, w, None, out, cfg, part, locks)
    torch.cuda.synchronize()


def parse_metrics(text: str) -> dict[str, float]:
    """The profiler's `--metrics` table: {metric: value} (thousands separators dropped)."""
    found = {}
    for line in text.splitlines():
        m = re.match(r"\s+([a-z_]+__\S+)\s+(?:\S+\s+)?([\d,]+(?:\.\d+)?)\s*$", line)
        if m:
            found[m.group(1)] = float(m.group(2).replace(",", ""))
    return found


def parse_source(text: str) -> list[dict]:
    """The profiler's per-instruction table (`--page source --print-source sass --csv`): one dict per machine
    instruction with its text, warp samples, executions and samples per stall reason."""
    start = text.find('"Address","Source"')
    if start < 0:
        raise ValueError("no per-instruction table in the profiler's output")
    rows = list(csv.reader(io.StringIO(text[start:])))
    head, body = rows[0], [r for r in rows[1:] if len(r) == len(rows[0])]
    col = {h: i for i, h in enumerate(head)}
    reasons = [h for h in head if h.startswith("stall_") and "Not Issued" not in h]
    out = []
    for r in body:
        out.append({"addr": int(r[0], 16), "sass": r[1].strip(),
                    "samples": int(r[col["Warp Stall Sampling (All Samples)"]] or 0),
                    "reasons": {h[len("stall_"):]: int(r[col[h]] or 0) for h in reasons if int(r[col[h]] or 0)}})
    return out


def _split(sass: str) -> tuple[str, list[str]]:
    """(opcode with modifiers, operands) of one instruction's text, the predicate dropped."""
    text = re.sub(r"^@!?U?P\w+\s+", "", sass.strip())
    op, _, rest = text.partition(" ")
    return op, [o.strip() for o in rest.split(",")] if rest else []


def _written(op: str, operands: list[str]) -> set[int]:
    """Registers an instruction writes (its first operand, wide loads several)."""
    if not operands or op.split(".")[0] in ("ST", "STG", "STS", "STL", "RED", "BRA", "BAR", "EXIT") or \
            not (m := REG.fullmatch(operands[0])):
        return set()
    width = next((w for bits, w in WIDTH.items() if f".{bits}" in op), 1)
    return set(range(int(m.group(1)), int(m.group(1)) + width))


def _read(op: str, operands: list[str]) -> set[int]:
    """Registers an instruction reads."""
    srcs = operands if op.split(".")[0] in ("ST", "STG", "STS", "STL", "RED") else operands[1:]
    return {int(r) for o in srcs for r in REG.findall(o)}


def loops(instrs: list[dict]) -> list[tuple[int, int]]:
    """(first, last) instruction index of each loop (`scripts/kernel_sass.loops`: a branch back to an earlier
    address)."""
    return _code_loops([(ins["addr"], op, ", ".join(operands))
                        for ins in instrs for op, operands in [_split(ins["sass"])]])


def waited_load(instrs: list[dict], i: int, spans: list[tuple[int, int]] | None = None) -> dict | None:
    """The load (global, local or shared) that instruction i's operands come from, if the nearest writer of one
    of them is a load, searching backwards and around the enclosing loop's back edge (`spans`: `loops(instrs)`):
    its address, opcode and distance in instructions."""
    reads = _read(*_split(instrs[i]["sass"]))
    if not reads:
        return None
    span = next(((a, b) for a, b in (loops(instrs) if spans is None else spans) if a <= i <= b), None)
    order = list(range(i - 1, -1, -1)) if span is None else \
        list(range(i - 1, span[0] - 1, -1)) + list(range(span[1], i, -1))
    for dist, j in enumerate(order, start=1):
        op, operands = _split(instrs[j]["sass"])
        hit = _written(op, operands) & reads
        if hit:
            if op.split(".")[0] in ("LDG", "LDL", "LDS", "LD"):
                return {"load_addr": hex(instrs[j]["addr"]), "load": instrs[j]["sass"], "distance": dist}
            reads -= hit
            if not reads:
                return None
    return None


def summarize(instrs: list[dict], metrics: dict[str, float], top: int = 12) -> dict:
    """Stall reasons (samples, share), the hottest lines with their waited-for loads, and the metrics."""
    total = sum(ins["samples"] for ins in instrs)
    by_reason: dict[str, int] = {}
    for ins in instrs:
        for k, v in ins["reasons"].items():
            by_reason[k] = by_reason.get(k, 0) + v
    hot = sorted(range(len(instrs)), key=lambda i: -instrs[i]["samples"])[:top]
    spans = loops(instrs)
    return {
        "samples": total,
        "reasons_share": {k: round(v / max(total, 1), 4) for k, v in sorted(by_reason.items(), key=lambda kv: -kv[1])},
        "loops": [{"first": hex(instrs[a]["addr"]), "last": hex(instrs[b]["addr"]), "instructions": b - a + 1}
                  for a, b in spans],
        "hot": [{"addr": hex(instrs[i]["addr"]), "sass": instrs[i]["sass"], "samples": instrs[i]["samples"],
                 "share": round(instrs[i]["samples"] / max(total, 1), 4), "reasons": instrs[i]["reasons"],
                 "waits_for": waited_load(instrs, i, spans)} for i in hot],
        "metrics": metrics,
    }


def _ncu(args: list[str]) -> str:
    """The profiler's stdout; a clear message when it is missing or refuses (e.g. no access to the counters)."""
    res = subprocess.run(args, capture_output=True, text=True)
    if res.returncode != 0 or "==ERROR==" in res.stdout:
        tail = "\n".join((res.stdout + res.stderr).strip().splitlines()[-8:])
        raise SystemExit(f"the profiler failed (exit {res.returncode}): {' '.join(args[:3])} ...\n{tail}")
    return res.stdout


def _stem(name: str, rows: int, async_dots: bool = False) -> str:
    """Raw files' name stem: the projection, the rows beyond one, and the asynchronous-dot kernel."""
    return (name if rows == 1 else f"{name}_t{rows}") + ("_async" if async_dots else "")


def profile(name: str, raw: Path, rows: int = 1, async_dots: bool = False) -> None:
    """Runs the profiler twice on `--launch name` (metrics; per-instruction samples) into raw/."""
    if shutil.which("ncu") is None:
        raise SystemExit("the GPU profiler's command line (ncu, in the CUDA toolkit's bin) is not on the PATH")
    base = ["ncu", "--kernel-name", ASYNC_KERNELS if async_dots else KERNELS[rows == 1], "--launch-skip", "4",
            "--launch-count", "1", "--clock-control", "none"]
    me = [sys.executable, str(Path(__file__).resolve()), "--launch", name, "--rows", str(rows)] \
        + (["--async-dots"] if async_dots else [])
    metrics = ",".join((STALL_METRICS,) + OTHER_METRICS)
    source = ["--section", "SourceCounters", "--section", "WarpStateStats", "--page", "source",
              "--print-source", "sass", "--csv"]
    (raw / f"{_stem(name, rows, async_dots)}_metrics.txt").write_text(_ncu(base + ["--metrics", metrics] + me))
    (raw / f"{_stem(name, rows, async_dots)}_source.csv").write_text(_ncu(base + source + me))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--shapes", default="gate_up,down")
    ap.add_argument("--parse", type=Path, help="a raw folder of an earlier run: summarize it again, no GPU")
    ap.add_argument("--raw", type=Path, help="where the profiler's raw output goes (default: <out stem>_raw/)")
    ap.add_argument("--rows", type=int, default=1, help="token rows (1: the one-row kernel; 2-64: the tiles)")
    ap.add_argument("--async-dots", action="store_true",
                    help="pick_config given async_dots (sm_90+): the asynchronous-dot kernel at 2-32 rows")
    ap.add_argument("--launch", choices=sorted(SHAPES), help=argparse.SUPPRESS)
    ap.add_argument("--commit", default="")
    args = ap.parse_args()
    if not 1 <= args.rows <= 64:
        ap.error("--rows: 1 to 64 (more rows dequantize for a library GEMM)")
    if args.launch:
        launch(args.launch, args.rows, args.async_dots)
        return
    if args.out is None:
        ap.error("--out is required")
    raw = args.parse or args.raw or args.out.with_name(args.out.stem + "_raw")
    raw.mkdir(parents=True, exist_ok=True)
    if not args.parse:      # the card's name and the date, kept with the raw output for a later --parse
        name = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader", "-i", "0"],
                              capture_output=True, text=True, check=True).stdout.strip()
        (raw / "device.txt").write_text(name + "\n")
        (raw / "date.txt").write_text(datetime.now(timezone.utc).isoformat(timespec="seconds") + "\n")
    device, date = ((raw / f).read_text().strip() if (raw / f).exists() else None for f in ("device.txt", "date.txt"))
    command = f"python3 bench/quant_gemv_stalls.py --shapes {args.shapes}" + (f" --rows {args.rows}" if args.rows > 1
                                                                               else "") \
        + (" --async-dots" if args.async_dots else "")
    res: dict = {"device": device, "date": date, "commit": args.commit, "command": command, "rows": args.rows,
                 "async_dots": args.async_dots, "bits": 4, "group_size": 128, "shapes": {}}
    for name in args.shapes.split(","):
        if not args.parse:
            profile(name, raw, args.rows, args.async_dots)
        stem = _stem(name, args.rows, args.async_dots)
        src = (raw / f"{stem}_source.csv").read_text()
        cfg = re.search(r"block_n=(\d+), block_m=(\d+), split_k=(\d+), num_warps=(\d+)", src)
        kernel = re.search(r'"Kernel Name","([^"]+)"', src)
        res["shapes"][name] = {"nk": SHAPES[name], "config": [int(v) for v in cfg.groups()] if cfg else None,
                               "kernel": kernel.group(1) if kernel else None,
                               **summarize(parse_source(src), parse_metrics((raw / f"{stem}_metrics.txt").read_text()))}
        s = res["shapes"][name]
        print(f"{name}: {s['metrics'].get('gpu__time_duration.sum', 0):.1f} us, "
              + ", ".join(f"{k} {v:.0%}" for k, v in list(s["reasons_share"].items())[:5]), flush=True)
        for h in s["hot"][:5]:
            w = h["waits_for"]
            waits = f" <- {w['load'][:30]} {w['distance']} earlier" if w else ""
            print(f"  {h['share']:5.1%} {h['sass'][:56]:56s}{waits}")
    args.out.write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
