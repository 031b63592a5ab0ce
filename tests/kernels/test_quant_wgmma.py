"""The asynchronous-dot 4-bit kernel (`kernels.quant_wgmma`): compiled for Hopper with no GPU, each half block's 8
tensor-core instructions issue back to back and the program waits for all but the latest group (two dots in
flight), never after each instruction (what the assembler does when a running dot's accumulators are read or
copied), with one warpgroup a program or two, and the barriers of each half-block synchronisation; the launcher
and quant_matmul refuse what the kernel cannot do;
pick_config's rule for it; on a GPU, the fp32 dequantize-then-matmul reference (tiles of 64 and 128 features with
masked rows and features, a bias, split-K summed in order and deterministic, groups of 128 and 256; 128 features
also through quant_matmul) and QuantLinear taking it at 2-32 rows."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
TOOLS = Path(__import__("triton").__file__).parent / "backends" / "nvidia" / "bin"
sys.path.insert(0, str(ROOT / "scripts"))


def sass(tmp_path: Path, **consts: int) -> tuple[str, list[tuple[int, str, str]]]:
    """(kernel_sass.py's report, the machine code) of the kernel compiled for sm_90 with `consts` over a 16-row
    tile of 64 features, a ring of 4 taken 4 a step, no split, a bias."""
    from kernel_sass import parse_sass

    consts = {"GROUP": 128, "BLOCK_M": 16, "NX": 4, "U": 4, "SPLIT": 1, "HAS_BIAS": 1, "FENCE": 1, "USE_PDL": 1,
              "BLOCK_N": 64, **consts}
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "_".join(f"{k}{v}" for k, v in consts.items())
    cmd = [sys.executable, str(ROOT / "scripts" / "kernel_sass.py"), "kernels.quant_wgmma:quant_wgmma_kernel",
           "--warps", str(consts["BLOCK_N"] // 16), "--const", *(f"{k}={v}" for k, v in consts.items()),
           "--ptr", "x_ptr=bf16", "w_ptr=i32", "s_ptr=fp16", "o_ptr=fp16", "xs_ptr=fp32", "bias_ptr=bf16",
           "out_ptr=bf16", "part_ptr=fp32", "lock_ptr=i32", "--aligned", "N", "stride_x", "stride_out",
           "words_per_row", "--dump", str(out)]
    run = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    return run.stdout, parse_sass((out / "kernel.sass").read_text())


@pytest.mark.skipif(not (TOOLS / "cuobjdump").exists(), reason="Triton's CUDA tools are not installed")
@pytest.mark.parametrize("block_m,split,block_n", [(16, 1, 64), (32, 2, 64), (8, 1, 128), (32, 2, 128)])
def test_two_dots_in_flight(block_m: int, split: int, block_n: int, tmp_path: Path) -> None:
    report, code = sass(tmp_path, BLOCK_M=block_m, SPLIT=split, BLOCK_N=block_n)
    if block_m <= 16 or block_n == 128:     # two warpgroups: x's copies spread over twice the threads
        assert "stack (spills) 0 B" in report, report.splitlines()[0]
    ops = [op for _, op, _ in code]
    groups, current = [], []
    for op, (_, _, args) in zip(ops, code):
        if op.startswith("HGMMA"):
            current.append(op)
            if "gsb0" in args:                  # the group's last instruction
                groups.append(current)
                current = []
    assert groups and all(len(g) == 8 for g in groups), [len(g) for g in groups]   # K = 128: 8 x k16
    first = ops.index(next(op for op in ops if op.startswith("HGMMA")))
    between = []                               # waits between two instructions of one group
    seen = 0
    for op, (_, _, args) in zip(ops[first:], code[first:]):
        if op.startswith("HGMMA"):
            seen = 0 if "gsb0" in args else 1
        elif seen and op.startswith("WARPGROUP.DEPBAR"):
            between.append(op)
    assert not between, f"the assembler waits inside a dot's group: {between[:4]}"
    waits = [args.strip() for (_, op, args) in code if op.startswith("WARPGROUP.DEPBAR")]
    assert any(w.endswith("0x1") for w in waits), waits           # one group left running while the next issues


@pytest.mark.skipif(not (TOOLS / "cuobjdump").exists(), reason="Triton's CUDA tools are not installed")
def test_each_half_block_synchronisation_s_barriers(tmp_path: Path) -> None:
    """SYNC 0: three block-wide barriers a half block (ours after the fence, the compiler's between the wait and
    the fence, the refill's); 1, barrier before fence: two, the fences kept; 2, as 1 with the refill into half
    h - 2's slot and no barrier of its own: one where the compiler tells the ring's slots apart (Triton 3.9), two
    where it does not (3.6 adds one before the refill)."""
    from kernel_sass import loops

    counts = {}
    for sync in (0, 1, 2):
        _, code = sass(tmp_path, BLOCK_M=8, NX=8, U=2, HAS_BIAS=0, SYNC=sync)
        first, last = max(loops(code), key=lambda span: span[1] - span[0])
        body = [op for _, op, _ in code[first:last + 1]]
        counts[sync] = (sum(op.startswith("BAR.SYNC") for op in body), sum(op.startswith("MEMBAR") for op in body))
    # two half blocks a loop step
    assert counts[0] == (6, 2) and counts[1] == (4, 2) and counts[2] in ((2, 2), (4, 2)), counts


def test_the_launcher_refuses_what_the_kernel_cannot_do() -> None:
    from kernels.quant_pack import pack_quantized
    from kernels.quant_wgmma import quant_wgmma

    gen = torch.Generator().manual_seed(0)

    def weight(K: int, group: int, bits: int = 4):
        q = torch.randint(0, 2**bits, (64, K), dtype=torch.uint8, generator=gen)
        s = (torch.rand(64, K // group, generator=gen) * 0.01 + 1e-3).half()
        return pack_quantized(q, s, (-8 * s.float()).half(), bits, group)

    x = torch.randn(8, 512).to(torch.bfloat16)
    out = torch.empty(8, 64, dtype=torch.bfloat16)
    sums = torch.zeros(8, 4)
    with pytest.raises(ValueError, match="bfloat16"):
        quant_wgmma(x.half(), weight(512, 128), None, out, sums)
    with pytest.raises(ValueError, match="groups of 128"):
        quant_wgmma(x, weight(512, 32), None, out, sums)
    with pytest.raises(ValueError, match="multiple of 1024"):
        quant_wgmma(x, weight(512, 128), None, out, sums, split=2)
    with pytest.raises(ValueError, match="block_m"):
        quant_wgmma(x, weight(512, 128), None, out, sums, block_m=12)
    with pytest.raises(ValueError, match="block_n"):
        quant_wgmma(x, weight(512, 128), None, out, sums, block_m=16, block_n=96)
    with pytest.raises(ValueError, match="partials"):
        quant_wgmma(torch.randn(8, 1024).to(torch.bfloat16), weight(1024, 128), None, out, torch.zeros(8, 8),
                    split=2)


def test_pick_config_takes_the_kernel_where_it_was_faster() -> None:
    """2-32 rows of the 8B shapes (4 bits, groups of 128, bfloat16 x) with `async_dots`, 128 features a program
    on gate/up and down at 9-16 rows (64 elsewhere); not at 1 or 33+ rows, not for float16 x, small weights or
    groups of 32, nor without `async_dots`, nor 2-16 rows beside a LoRA launch; a split or step that does not
    divide K's half blocks steps down."""
    from kernels.quant_config import pick_config

    expect = {  # (T, N, K): (block_n, block_m, split, ring, step)
        (2, 6144, 4096): (64, 8, 4, 4, 4), (8, 4096, 4096): (64, 8, 4, 4, 4), (8, 4096, 14336): (64, 8, 8, 8, 2),
        (8, 28672, 4096): (64, 8, 1, 6, 2), (9, 6144, 4096): (64, 16, 4, 4, 4),
        (16, 28672, 4096): (128, 16, 1, 6, 2), (9, 28672, 4096): (128, 16, 1, 6, 2),
        (16, 4096, 14336): (128, 16, 4, 8, 2), (16, 4096, 4096): (64, 16, 4, 4, 4),
        (17, 6144, 4096): (64, 32, 1, 6, 2), (32, 4096, 4096): (64, 32, 4, 4, 4), (32, 4096, 14336): (64, 32, 4, 4, 4),
        (32, 28672, 4096): (64, 32, 1, 6, 2)}
    for (T, N, K), want in expect.items():
        cfg = pick_config(T, N, K, 4, 132, 128, torch.bfloat16, async_dots=True)
        assert (cfg.block_n, cfg.block_m, cfg.split_k, cfg.ring, cfg.ring_step) == want, (T, N, K, cfg)
        assert (K // 128) % (cfg.split_k * cfg.ring_step) == 0
        assert pick_config(T, N, K, 4, 132, 128, torch.bfloat16).ring == 0
    assert pick_config(1, 4096, 4096, 4, 132, 128, torch.bfloat16, async_dots=True).ring == 0
    assert pick_config(16, 4096, 4096, 4, 132, 128, torch.bfloat16, True, async_dots=True).ring == 0  # LoRA beside
    assert pick_config(32, 4096, 4096, 4, 132, 128, torch.bfloat16, True, async_dots=True).ring == 4
    assert pick_config(33, 4096, 4096, 4, 132, 128, torch.bfloat16, async_dots=True).ring == 0
    assert pick_config(8, 4096, 4096, 4, 132, 128, torch.float16, async_dots=True).ring == 0
    assert pick_config(8, 960, 576, 4, 132, 128, torch.bfloat16, async_dots=True).ring == 0
    assert pick_config(8, 4096, 4096, 4, 132, 32, torch.bfloat16, async_dots=True).ring == 0
    odd = pick_config(8, 4096, 128 * 14, 4, 132, 128, torch.bfloat16, async_dots=True)    # 14 halves: split 1, step 2
    assert (odd.split_k, odd.ring_step, odd.ring) == (1, 2, 6), odd
    assert pick_config(8, 4096, 128 * 35, 4, 132, 128, torch.bfloat16, async_dots=True).ring == 0   # 35 halves


def test_pick_config_takes_the_wide_tiles_for_many_rows_of_gate_up() -> None:
    """65+ rows of a 4-bit g128 weight whose 64-feature tiles fill the SMs twice (the 8B's gate/up) with
    bfloat16 x and `async_dots`: 128-row tiles of 64 features, at 193-256 rows one 256-row tile of 128, a ring of
    3, no split; 129-192 rows keep the tiles, as do q/k/v, o and down, float16 x, groups of 32 and GPUs without
    the kernel."""
    from kernels.quant_config import QuantMatmulConfig, pick_config
    from kernels.quant_matmul import sums_width, wide_ring
    from kernels.quant_pack import pack_quantized

    gate_up = (28672, 4096, 4, 132, 128, torch.bfloat16)
    assert pick_config(65, *gate_up, async_dots=True) == QuantMatmulConfig(64, 128, 1, ring=3, ring_step=1)
    assert pick_config(128, *gate_up, async_dots=True) == QuantMatmulConfig(64, 128, 1, ring=3, ring_step=1)
    assert pick_config(129, *gate_up, async_dots=True).ring == 0
    assert pick_config(192, *gate_up, async_dots=True).ring == 0
    assert pick_config(193, *gate_up, async_dots=True) == QuantMatmulConfig(128, 256, 1, ring=3, ring_step=1)
    assert pick_config(256, *gate_up, async_dots=True) == QuantMatmulConfig(128, 256, 1, ring=3, ring_step=1)
    assert pick_config(383, *gate_up, async_dots=True) == QuantMatmulConfig(64, 128, 1, ring=3, ring_step=1)
    assert pick_config(64, *gate_up, async_dots=True).ring == 0
    assert pick_config(128, *gate_up).ring == 0
    assert pick_config(128, 28672, 4096, 4, 132, 128, torch.float16, async_dots=True).ring == 0
    assert pick_config(128, 28672, 4096, 4, 132, 32, torch.bfloat16, async_dots=True).ring == 0
    for n, k in ((6144, 4096), (4096, 4096), (4096, 14336)):
        assert pick_config(256, n, k, 4, 132, 128, torch.bfloat16, async_dots=True).ring == 0, (n, k)
    q = torch.randint(0, 16, (64, 1024), dtype=torch.uint8)
    s = (torch.rand(64, 8) * 0.01 + 1e-3).half()
    w = pack_quantized(q, s, (-8 * s.float()).half(), 4, 128)
    wide = pick_config(250, *gate_up, async_dots=True)
    assert wide_ring(wide) and sums_width(wide, w, torch.bfloat16) == 0      # the norms write no sums for it
    assert sums_width(pick_config(200, *gate_up), w, torch.bfloat16) == 128


def test_one_row_takes_the_kernel_only_when_asked_and_alone() -> None:
    """`async_one_row` (LORAPLEX_ASYNC_DOTS_ONE_ROW, for A/B runs): one row of a large 4-bit g128 weight takes the
    kernel's 8-row tile, not beside a LoRA launch (the one-row kernel adds that launch's delta) nor without
    `async_dots`; off, one row keeps the one-row kernels."""
    from kernels.quant_config import pick_config

    for N, K in ((6144, 4096), (28672, 4096), (4096, 14336)):
        on = pick_config(1, N, K, 4, 132, 128, torch.bfloat16, async_dots=True, async_one_row=True)
        assert on.ring > 0 and on.block_m == 8, (N, K, on)
        assert pick_config(1, N, K, 4, 132, 128, torch.bfloat16, async_dots=True).ring == 0
        assert pick_config(1, N, K, 4, 132, 128, torch.bfloat16, True, True, True).ring == 0      # LoRA beside
        assert pick_config(1, N, K, 4, 132, 128, torch.bfloat16, async_one_row=True).ring == 0
    assert pick_config(1, 960, 576, 4, 132, 128, torch.bfloat16, async_dots=True, async_one_row=True).ring == 0


def test_one_row_switch_is_read_from_the_environment(monkeypatch) -> None:
    from kernels.quant_wgmma import ONE_ROW_ENV, async_one_row_enabled

    monkeypatch.delenv(ONE_ROW_ENV, raising=False)
    assert not async_one_row_enabled()
    monkeypatch.setenv(ONE_ROW_ENV, "1")
    assert async_one_row_enabled()
    monkeypatch.setenv(ONE_ROW_ENV, "2")
    with pytest.raises(ValueError, match=ONE_ROW_ENV):
        async_one_row_enabled()


def test_synchronisation_defaults_to_barrier_before_fence(monkeypatch) -> None:
    """SYNC 1 where LORAPLEX_ASYNC_DOTS_SYNC is unset or blank (the engine A/B's winner); 0 and 2 on request;
    anything else an error naming the variable."""
    from kernels.quant_wgmma import SYNC_ENV, ring_sync

    monkeypatch.delenv(SYNC_ENV, raising=False)
    assert ring_sync() == 1
    monkeypatch.setenv(SYNC_ENV, " ")
    assert ring_sync() == 1
    for v in (0, 1, 2):
        monkeypatch.setenv(SYNC_ENV, str(v))
        assert ring_sync() == v
    monkeypatch.setenv(SYNC_ENV, "3")
    with pytest.raises(ValueError, match=SYNC_ENV):
        ring_sync()


def test_quant_matmul_refuses_a_ring_it_cannot_run() -> None:
    """On the CPU (or for float16 x) a config with a ring is an error, not a silent fallback."""
    from kernels.quant_config import QuantMatmulConfig
    from kernels.quant_matmul import quant_matmul
    from kernels.quant_pack import pack_quantized

    q = torch.randint(0, 16, (64, 1024), dtype=torch.uint8)
    s = (torch.rand(64, 8) * 0.01 + 1e-3).half()
    w = pack_quantized(q, s, (-8 * s.float()).half(), 4, 128)
    x = torch.randn(8, 1024).to(torch.bfloat16)
    out = torch.empty(8, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="asynchronous-dot"):
        quant_matmul(x, w, None, out, QuantMatmulConfig(64, 8, 1, ring=4, ring_step=4))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="needs a CUDA GPU of sm_90 or later")
@pytest.mark.parametrize("T,N,K,group,block_m,split", [(16, 128, 1024, 128, 16, 1), (20, 96, 2048, 256, 32, 2),
                                                       (32, 6144, 4096, 128, 32, 1), (64, 4096, 14336, 128, 32, 4),
                                                       (3, 192, 2048, 128, 8, 2), (1, 4096, 4096, 128, 16, 1),
                                                       (70, 256, 1024, 128, 64, 1)])
@pytest.mark.parametrize("block_n,sync", [(64, 0), (128, 0), (64, 1), (128, 1), (64, 2), (128, 2)])
def test_gpu_matches_reference(T: int, N: int, K: int, group: int, block_m: int, split: int, block_n: int,
                               sync: int) -> None:
    from kernels.quant_matmul import half_sums
    from kernels.quant_pack import pack_quantized
    from kernels.quant_wgmma import quant_wgmma

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(T * 7 + split)
    q = torch.randint(0, 16, (N, K), dtype=torch.uint8, device=dev, generator=gen)
    s = (torch.rand(N, K // group, device=dev, generator=gen) * 0.01 + 1e-3).half()
    o = (-8 * s.float() + torch.randn(N, K // group, device=dev, generator=gen) * 1e-3).half()
    w = pack_quantized(q, s, o, 4, group)
    x = torch.randn(T, K, device=dev, generator=gen).to(torch.bfloat16)
    bias = (torch.randn(N, device=dev, generator=gen) * 0.1).to(torch.bfloat16) if split > 1 else None
    g = torch.arange(K, device=dev) // group
    want = x.float() @ (q.float() * s.float()[:, g] + o.float()[:, g]).t()
    if bias is not None:
        want += bias.float()
    outs = [torch.full((T, N), float("nan"), dtype=torch.bfloat16, device=dev) for _ in range(2)]
    partials = torch.empty(split * T * N, device=dev)
    locks = torch.zeros(4096, dtype=torch.int32, device=dev)
    for out in outs:
        quant_wgmma(x, w, bias, out, half_sums(x), block_m=block_m, split=split, partials=partials, locks=locks,
                    block_n=block_n, sync=sync)
    err = ((outs[0].float() - want).norm() / want.norm()).item()
    assert err < 1e-2, f"rel err {err}"
    assert torch.equal(outs[0], outs[1])            # split-K sums in a fixed order
    assert not locks.any()                          # the counters are left zero


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="needs a CUDA GPU of sm_90 or later")
@pytest.mark.parametrize("T,N,K,group,block_m,split,nx", [
    (130, 192, 1024, 128, 128, 1, 4), (300, 96, 2048, 256, 256, 2, 3), (128, 4096, 4096, 128, 128, 2, 3),
    (257, 320, 1024, 128, 128, 4, 4)])
@pytest.mark.parametrize("block_n", [64, 128])
def test_gpu_wide_tiles_dequantize_into_the_operand(T: int, N: int, K: int, group: int, block_m: int, split: int,
                                                    nx: int, block_n: int) -> None:
    """128- and 256-row tiles (DEQ): each weight q * s + o rounded to bfloat16 once, then the dot, so the result
    is the dense path's (x against W in bfloat16, fp32 sums) to the output's rounding, and the fp32 reference's
    to 1e-2; masked rows and features, a bias, split-K summed in order with its counters left zero, no sums of
    x read (None passed)."""
    from kernels.quant_pack import pack_quantized
    from kernels.quant_wgmma import quant_wgmma

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(T + split)
    q = torch.randint(0, 16, (N, K), dtype=torch.uint8, device=dev, generator=gen)
    s = (torch.rand(N, K // group, device=dev, generator=gen) * 0.01 + 1e-3).half()
    o = (-8 * s.float() + torch.randn(N, K // group, device=dev, generator=gen) * 1e-3).half()
    x = torch.randn(T, K, device=dev, generator=gen).to(torch.bfloat16)
    bias = (torch.randn(N, device=dev, generator=gen) * 0.1).to(torch.bfloat16)
    g = torch.arange(K, device=dev) // group
    w32 = q.float() * s.float()[:, g] + o.float()[:, g]
    want = x.float() @ w32.t() + bias.float()
    dense = x.float() @ w32.to(torch.bfloat16).float().t() + bias.float()
    outs = [torch.full((T, N), float("nan"), dtype=torch.bfloat16, device=dev) for _ in range(2)]
    partials = torch.empty(split * T * N, device=dev)
    locks = torch.zeros(4096, dtype=torch.int32, device=dev)
    for out in outs:
        quant_wgmma(x, pack_quantized(q, s, o, 4, group), bias, out, None, block_m=block_m, split=split, nx=nx, u=1,
                    partials=partials, locks=locks, block_n=block_n)
    assert ((outs[0].float() - dense).norm() / dense.norm()).item() < 4e-3
    assert ((outs[0].float() - want).norm() / want.norm()).item() < 1e-2
    assert torch.equal(outs[0], outs[1])
    assert not locks.any()


def _case(T: int, N: int, K: int, seed: int):
    """(device, a random 4-bit weight in groups of 128, bfloat16 x [T, K], the fp32 reference x @ W.T)."""
    from kernels.quant_pack import pack_quantized

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(seed)
    q = torch.randint(0, 16, (N, K), dtype=torch.uint8, device=dev, generator=gen)
    s = (torch.rand(N, K // 128, device=dev, generator=gen) * 0.01 + 1e-3).half()
    o = (-8 * s.float()).half()
    x = torch.randn(T, K, device=dev, generator=gen).to(torch.bfloat16)
    g = torch.arange(K, device=dev) // 128
    return dev, pack_quantized(q, s, o, 4, 128), x, x.float() @ (q.float() * s.float()[:, g] + o.float()[:, g]).t()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="needs a CUDA GPU of sm_90 or later")
@pytest.mark.parametrize("nx,u", [(3, 1), (6, 2), (8, 2)])
@pytest.mark.parametrize("sync", [0, 1, 2])
def test_gpu_rings_and_syncs(nx: int, u: int, sync: int) -> None:
    """Every half-block synchronisation with the smallest ring (3 slots: the early refill keeps one half ahead)
    and the picked ones, one and two warpgroups, split-K: the same sums as the plain order, to rounding."""
    from kernels.quant_matmul import half_sums
    from kernels.quant_wgmma import quant_wgmma

    T, N = 24, 320
    dev, w, x, want = _case(T, N, 2048, nx * 10 + u)
    partials = torch.empty(2 * T * N, device=dev)
    locks = torch.zeros(4096, dtype=torch.int32, device=dev)
    for block_n in (64, 128):
        out = torch.full((T, N), float("nan"), dtype=torch.bfloat16, device=dev)
        quant_wgmma(x, w, None, out, half_sums(x), block_m=32, split=2, nx=nx, u=u, partials=partials, locks=locks,
                    block_n=block_n, sync=sync)
        assert ((out.float() - want).norm() / want.norm()).item() < 1e-2, (block_n, sync)
        assert not locks.any()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="needs a CUDA GPU of sm_90 or later")
def test_gpu_quant_matmul_runs_two_warpgroups() -> None:
    """A ring config of 128 features through quant_matmul (its sums of x computed there) against the reference."""
    from kernels.quant_config import QuantMatmulConfig
    from kernels.quant_matmul import quant_matmul

    T, N = 48, 4096 + 64
    dev, w, x, want = _case(T, N, 2048, 5)
    out = torch.full((T, N), float("nan"), dtype=torch.bfloat16, device=dev)
    quant_matmul(x, w, None, out, QuantMatmulConfig(128, 64, 1, ring=6, ring_step=2))
    assert ((out.float() - want).norm() / want.norm()).item() < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="needs a CUDA GPU of sm_90 or later")
def test_gpu_quant_linear_one_row_on_the_kernel_when_asked(monkeypatch) -> None:
    """LORAPLEX_ASYNC_DOTS_ONE_ROW=1: a QuantLinear's one row takes the kernel (its sums of x asked of the
    writer: sums_width 128), matches the reference; with an addend it keeps the one-row kernel."""
    from compute_service.engine.quant_linear import QuantLinear
    from compute_service.engine.quantized import QuantizedWeight
    from kernels.quant_wgmma import ONE_ROW_ENV

    monkeypatch.setenv(ONE_ROW_ENV, "1")
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(11)
    N, K, G = 4096, 4096, 128
    q = torch.randint(0, 16, (N, K), dtype=torch.uint8, device=dev, generator=gen)
    s = (torch.rand(N, K // G, device=dev, generator=gen) * 0.01 + 1e-3).half()
    o = (-8 * s.float()).half()
    lin = QuantLinear(QuantizedWeight(q, s, o, 4, G), bias=None, device=dev)
    assert lin.async_one_row and lin.sums_width(1, torch.bfloat16) == 128
    x = torch.randn(1, K, device=dev, generator=gen).to(torch.bfloat16)
    g = torch.arange(K, device=dev) // G
    want = x.float() @ (q.float() * s.float()[:, g] + o.float()[:, g]).t()
    assert ((lin(x).float() - want).norm() / want.norm()).item() < 1e-2
    addend = torch.zeros(1, N, device=dev)
    assert ((lin(x, addend=addend).float() - want).norm() / want.norm()).item() < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="needs a CUDA GPU of sm_90 or later")
@pytest.mark.parametrize("T,shape", [(2, "square"), (8, "square"), (13, "square"), (32, "square"),
                                     (13, "long_k"), (13, "wide"), (8, "wide")])
def test_gpu_quant_linear_takes_it(T: int, shape: str) -> None:
    """A QuantLinear on an sm_90 GPU runs the kernel at 2-32 rows (pick_config's rule), with a bias, and matches
    the fp32 reference; with LORAPLEX_ASYNC_DOTS=0 the tiles give the same result to rounding. A long K (down)
    and features that fill the SMs twice (gate/up) at 9-16 rows take 128 features a program."""
    from compute_service.engine.quant_linear import QuantLinear
    from compute_service.engine.quantized import QuantizedWeight
    from kernels.quant_matmul import pick_config

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(T)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    N, K = {"square": (4096, 4096), "long_k": (4096, 14336), "wide": (128 * sms, 4096)}[shape]
    G = 128
    q = torch.randint(0, 16, (N, K), dtype=torch.uint8, device=dev, generator=gen)
    s = (torch.rand(N, K // G, device=dev, generator=gen) * 0.01 + 1e-3).half()
    o = (-8 * s.float()).half()
    bias = torch.randn(N, device=dev, generator=gen) * 0.1
    lin = QuantLinear(QuantizedWeight(q, s, o, 4, G), bias=bias, device=dev)
    assert lin.async_dots
    cfg = pick_config(T, N, K, 4, lin.num_sms, G, torch.bfloat16, async_dots=True)
    assert cfg.ring > 0 and cfg.block_n == (128 if shape != "square" and 8 < T <= 16 else 64), cfg
    x = torch.randn(T, K, device=dev, generator=gen).to(torch.bfloat16)
    g = torch.arange(K, device=dev) // G
    want = x.float() @ (q.float() * s.float()[:, g] + o.float()[:, g]).t() + bias.to(torch.bfloat16).float()
    got = lin(x).float()
    assert ((got - want).norm() / want.norm()).item() < 1e-2
    lin.async_dots = False
    tiles = lin(x).float()
    assert ((tiles - got).norm() / want.norm()).item() < 1e-2
