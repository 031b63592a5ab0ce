"""Compiles a Triton kernel for a GPU architecture on a machine without one and reports its machine code:
registers, spills, the launch's shared memory and how many programs fit an SM by each, the instruction mix,
and per loop the instruction count, the global loads the loop waits for in the same iteration they are
requested in (a prefetch that does not hide latency), and its barriers
and shared-memory stores and loads (a value moved between two layouts goes through shared memory behind
barriers, which hold the program's warps together; the compiler inserts such moves where a value is
produced in one layout and used in another, e.g. a [BN] load used across a [BN, K] tile).

    python3 scripts/kernel_sass.py kernels.quant_gemv:quant_gemv_kernel \\
        --const GROUP=128 BITS=4 BLOCK_N=64 SPLIT=1 HAS_BIAS=0 EVEN_K=1 FENCE=1 NUM_THREADS=128 ASM=1 \\
                USE_PDL=1 ADD=0 PAIRED=1 X32=1 \\
        --ptr x_ptr=bf16 w_ptr=i32 s_ptr=fp16 o_ptr=fp16 bias_ptr=bf16 out_ptr=bf16 lock_ptr=i32 \\
        --aligned N K stride_x stride_out words_per_row [--warps 4] [--maxnreg 168] [--dump DIR]
        [--desc w_desc=i32[128,32]]      # a tensor descriptor argument and its box (the TMA kernels)

A constexpr parameter with a default (`X: tl.constexpr = False`) takes that default unless --const names it
(the first line of the output lists the defaults taken). Other parameters not named in --const are runtime
arguments: `*_ptr` ones and those --ptr names pointers (fp32 unless --ptr says, 16-byte aligned), the rest int32
(multiples of 16 where --aligned names them: Triton specializes on that, and without it vector loads look scalar).
The waits are found statically: an instruction that reads a register whose latest writer in the loop body is a global
load (the first use after the load stalls the warp until it lands; a register copy at the loop's back edge
counts, which is how a value requested for the next iteration ends up waited for in this one).
"""
from __future__ import annotations

import argparse
import importlib
import inspect
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z0-9_.]+)\s*([^;]*);")


def parse_sass(text: str) -> list[tuple[int, str, str]]:
    """(address, opcode with modifiers, operands) of each instruction."""
    return [(int(m.group(1), 16), m.group(3), m.group(4)) for m in map(LINE.search, text.splitlines()) if m]


def loops(code: list[tuple[int, str, str]]) -> list[tuple[int, int]]:
    """(first, last) indices of each loop body: a branch to an earlier address closes one."""
    index = {addr: i for i, (addr, _, _) in enumerate(code)}
    found = []
    for i, (_, op, args) in enumerate(code):
        m = re.match(r"0x([0-9a-f]+)", args.strip())
        if op.startswith("BRA") and m and int(m.group(1), 16) in index and index[int(m.group(1), 16)] < i:
            found.append((index[int(m.group(1), 16)], i))
    return found


def waits(body: list[tuple[int, str, str]]) -> tuple[list[str], int, int]:
    """The global loads into registers of one iteration that are waited for in that same iteration (each
    with the first instruction that reads its result), the number of such loads, and how many are still in
    flight at the back edge (requested for a later iteration and not read before it). Asynchronous copies
    to shared memory (LDGSTS) write no register and are not counted."""
    pending: dict[str, int] = {}       # register -> address of the load writing it
    hits: dict[int, str] = {}
    loads = 0
    for addr, op, args in body:
        regs = re.findall(r"\bR(\d+)\b", args)
        load = op.startswith("LDG") and not op.startswith(("LDGSTS", "LDGDEPBAR"))   # async copies: no register
        writes = not op.startswith(("ST", "BAR", "BRA", "RED", "ATOM", "LDGSTS", "LDGDEPBAR"))
        dst, srcs = (regs[0], regs[1:]) if regs and writes else (None, regs)
        if load:
            srcs = re.findall(r"\[R(\d+)", args)
        for r in srcs:
            if r in pending:
                at = pending.pop(r)
                hits.setdefault(at, f"load at {at:05x} <- read at {addr:05x} by {op} {args.strip()[:40]}")
        if dst is not None:
            if load:
                loads += 1
                width = 4 if ".128" in op else 2 if ".64" in op else 1
                for k in range(width):
                    pending[str(int(dst) + k)] = addr
            else:
                pending.pop(dst, None)
    return list(hits.values()), loads, len(set(pending.values()) - set(hits))


def shared_traffic(body: list[tuple[int, str, str]]) -> tuple[int, int, int]:
    """Barriers (BAR.SYNC and the like; not the asynchronous copies' own waits), shared-memory stores and
    shared-memory loads (LDS, LDSM) in a loop body."""
    bars = sum(op.startswith("BAR") and not op.startswith("BAR.ARV") for _, op, _ in body)
    return bars, sum(op.startswith("STS") for _, op, _ in body), sum(op.startswith("LDS") for _, op, _ in body)


def mix(body: list[tuple[int, str, str]], top: int = 12) -> str:
    return " ".join(f"{op}:{n}" for op, n in Counter(op.split(".")[0] for _, op, _ in body).most_common(top))


def load_kernel(target: str):
    """The @triton.jit function named by "module:name" (compiled, not interpreted: TRITON_INTERPRET unset)."""
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        raise SystemExit("TRITON_INTERPRET=1 makes @triton.jit functions interpreted: unset it to compile")
    mod_name, _, name = target.partition(":")
    return getattr(importlib.import_module(mod_name), name)


def constexpr_defaults(kernel) -> dict[str, int]:
    """The kernel's constexpr parameters that have defaults, with them (bools as 0/1): compiled as runtime
    arguments instead, every branch they guard would be in the machine code, registers included."""
    return {p.name: int(p.default) for p in inspect.signature(kernel.fn).parameters.values()
            if p.default is not inspect.Parameter.empty and "constexpr" in str(p.annotation)}


def specialization(kernel, consts: dict[str, int], ptrs: dict[str, str], aligned: set[str],
                   descs: dict[str, str] | None = None) -> tuple[dict, dict, dict]:
    """(signature, constexprs, attrs) of one program of `kernel`, in the forms Triton's sources take: `consts`
    (over the kernel's constexpr defaults), pointers' element types, the integers divisible by 16."""
    name = kernel.fn.__name__
    params = list(inspect.signature(kernel.fn).parameters)
    descs = descs or {}
    unknown = (set(consts) | set(ptrs) | aligned | set(descs)) - set(params)
    if unknown:
        raise SystemExit(f"{name} has no parameters {sorted(unknown)}; it takes {params}")
    consts = {**constexpr_defaults(kernel), **consts}
    sig, attrs = {}, {}
    for i, p in enumerate(params):
        if p in consts:
            sig[p] = "constexpr"
        elif p in descs:
            sig[p] = f"tensordesc<{descs[p]}>"
        elif p.endswith("_ptr") or p in ptrs:
            sig[p] = "*" + ptrs.get(p, "fp32")
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[p] = "i32"
            if p in aligned:
                attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, {(params.index(p),): v for p, v in consts.items()}, attrs


def compile_kernel(kernel, consts: dict[str, int], ptrs: dict[str, str], aligned: set[str], warps: int = 4,
                   stages: int = 3, maxnreg: int | None = None, arch: int = 90, descs: dict[str, str] | None = None):
    import triton
    from triton.backends.compiler import GPUTarget

    from compute_service.compile_pool import source_class

    sig, constexprs, attrs = specialization(kernel, consts, ptrs, aligned, descs)
    src = source_class(kernel)(fn=kernel, signature=sig, constexprs=constexprs, attrs=attrs)
    options = {"num_warps": warps, "num_stages": stages, **({"maxnreg": maxnreg} if maxnreg else {})}
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)


# Per SM: (shared memory a GPU of this compute capability gives its programs in all, bytes). Every program also
# takes 1 KiB the system reserves; registers are 64K 32-bit a SM, allocated per warp in units of 256; at most
# 2048 threads and 32 programs a SM.
SHARED_PER_SM = {80: 167936, 86: 102400, 87: 167936, 89: 102400, 90: 233472, 100: 233472, 120: 102400}
RESERVED_SHARED = 1024
REGISTERS_PER_SM = 65536


def programs_per_sm(registers: int, shared: int, warps: int, arch: int) -> tuple[int, int | None]:
    """How many programs of `warps` warps fit on one SM by their registers (a thread's count) and threads, and
    by their shared memory (bytes a program; None for an architecture not in SHARED_PER_SM)."""
    per_warp = -(-registers * 32 // 256) * 256
    by_registers = min(REGISTERS_PER_SM // (per_warp * warps), 2048 // (32 * warps), 32)
    total = SHARED_PER_SM.get(arch)
    by_shared = None if total is None else min(total // (shared + RESERVED_SHARED), 32)
    return by_registers, by_shared


def not_resident(kernel, warps: int, arch: int, per_sm: int) -> str | None:
    """Why `per_sm` programs of a compiled kernel (a `warmup` result) cannot share one SM, or None: a persistent
    grid that is not resident at once never opens its barriers."""
    kernel._init_handles()             # loads the binary: its register count is known from then on
    fit = programs_per_sm(kernel.n_regs, kernel.metadata.shared, warps, arch)
    if min(n for n in fit if n is not None) < per_sm:
        return f"{kernel.n_regs} registers, {kernel.metadata.shared} B shared a program"
    return None


def report(compiled, dump: Path | None, warps: int = 4, arch: int = 90) -> str:
    import triton

    bindir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        sass = subprocess.run([str(bindir / "cuobjdump"), "-sass", str(cubin)], capture_output=True, text=True,
                              check=True).stdout
        usage = subprocess.run([str(bindir / "cuobjdump"), "-res-usage", str(cubin)], capture_output=True,
                               text=True, check=True).stdout
    if dump is not None:
        dump.mkdir(parents=True, exist_ok=True)
        for kind in ("ttir", "ttgir", "llir", "ptx"):
            if kind in compiled.asm.keys():             # an explicit-layout kernel starts at ttgir
                (dump / f"kernel.{kind}").write_text(compiled.asm[kind])
        (dump / "kernel.sass").write_text(sass)
    code = parse_sass(sass)
    res = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+)", usage)
    out = [f"registers {res.group(1)}, stack (spills) {res.group(2)} B, shared {res.group(3)} B" if res else usage]
    shared = compiled.metadata.shared         # what a launch asks for: the static part and the pipeline's buffers
    if res:
        by_registers, by_shared = programs_per_sm(int(res.group(1)), shared, warps, arch)
        out.append(f"launch shared memory {shared} B; programs an SM: {by_registers} by registers and threads"
                   + ("" if by_shared is None else f", {by_shared} by shared memory"))
    out.append(f"instructions {len(code)}: {mix(code)}")
    for first, last in loops(code):
        body = code[first:last + 1]
        hits, loads, in_flight = waits(body)
        bars, stores, shared_loads = shared_traffic(body)
        out.append(f"loop {body[0][0]:05x}-{body[-1][0]:05x}: {len(body)} instructions ({mix(body, 8)}); "
                   f"of its {loads} global loads {len(hits)} are waited for in the same iteration, {in_flight} "
                   f"are in flight at the back edge; {bars} barriers, {stores} shared stores, {shared_loads} "
                   "shared loads")
        out += ["  " + h for h in hits]
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("kernel", help="module:kernel, e.g. kernels.quant_gemv:quant_gemv_kernel")
    ap.add_argument("--const", nargs="*", default=[], metavar="NAME=INT", help="constexpr values (bools as 0/1)")
    ap.add_argument("--ptr", nargs="*", default=[], metavar="NAME=TYPE", help="pointee types (fp32, bf16, i32 ...)")
    ap.add_argument("--desc", nargs="*", default=[], metavar="NAME=TYPE",
                    help="tensor descriptor arguments and their boxes, e.g. w_desc=i32[64,16]")
    ap.add_argument("--aligned", nargs="*", default=[], metavar="NAME", help="int arguments that are multiples of 16")
    ap.add_argument("--warps", type=int, default=4)
    ap.add_argument("--stages", type=int, default=3)
    ap.add_argument("--maxnreg", type=int, default=None, help="cap on registers a thread")
    ap.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90 for Hopper")
    ap.add_argument("--dump", type=Path, help="write the intermediate forms and the machine code here")
    args = ap.parse_args()
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    consts = {k: int(v) for k, v in (c.split("=", 1) for c in args.const)}
    ptrs = dict(p.split("=", 1) for p in args.ptr)
    kernel = load_kernel(args.kernel)
    defaults = {k: v for k, v in constexpr_defaults(kernel).items() if k not in consts}
    compiled = compile_kernel(kernel, consts, ptrs, set(args.aligned), args.warps, args.stages,
                              args.maxnreg, args.arch, dict(d.split("=", 1) for d in args.desc))
    if defaults:
        print("constexpr defaults taken: " + " ".join(f"{k}={v}" for k, v in defaults.items()))
    print(report(compiled, args.dump, args.warps, args.arch))


if __name__ == "__main__":
    main()
