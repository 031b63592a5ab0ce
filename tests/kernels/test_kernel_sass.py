"""scripts/kernel_sass.py compiles a kernel for Hopper with no GPU and finds, per loop, the loads the loop
waits for in the iteration that requested them: all of them for a loop that reads each block as it loads
it, none for one that loads each block a step ahead into one of two register sets; a loop the compiler
pipelines through shared memory has no register loads to count; a value moved between layouts in the loop
shows as barriers and shared-memory traffic there."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOOLS = Path(__import__("triton").__file__).parent / "backends" / "nvidia" / "bin"
pytestmark = pytest.mark.skipif(not (TOOLS / "cuobjdump").exists(), reason="Triton's CUDA tools are not installed")


def report(kernel: str, *consts: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "tests" / "kernels"), env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "kernel_sass.py"), f"sass_probe:{kernel}",
                          "--const", "BLOCK=512", *consts], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    return run.stdout


def shared_lines(out: str) -> list[tuple[int, int, int]]:
    """(barriers, shared stores, shared loads) per loop."""
    return [tuple(map(int, m)) for m in re.findall(r"(\d+) barriers, (\d+) shared stores, (\d+) shared loads", out)]


def loop_lines(out: str) -> list[tuple[int, int, int]]:
    """(loads, waited in the same iteration, in flight at the back edge) per loop."""
    found = re.findall(r"of its (\d+) global loads (\d+) are waited for in the same iteration, (\d+) are in flight",
                       out)
    return [tuple(map(int, m)) for m in found]


def test_a_loop_that_reads_each_load_at_once_waits_for_all_of_them():
    out = report("sum_as_loaded")
    assert re.search(r"registers \d+, stack \(spills\) 0 B", out), out
    loops = loop_lines(out)
    assert loops and all(loads > 0 and waited == loads and ahead == 0 for loads, waited, ahead in loops), out


def test_loads_issued_a_step_ahead_are_in_flight_at_the_back_edge():
    loops = loop_lines(report("sum_one_ahead"))
    assert len(loops) == 1 and loops[0] == (2, 0, 2), loops


def test_copies_to_shared_memory_are_not_counted_as_register_loads():
    out = report("sum_pipelined")              # the compiler's pipeliner: asynchronous copies, read from shared
    assert "LDGSTS" in out, out
    assert loop_lines(out) and all(loads == 0 for loads, _, _ in loop_lines(out)), out


def test_a_constexpr_default_is_taken_unless_named():
    off = report("sum_with_option")
    assert "constexpr defaults taken: TWICE=0" in off, off
    on = report("sum_with_option", "TWICE=1")
    assert "constexpr defaults taken" not in on, on
    # the branch behind TWICE is compiled out by default (the loops of sum_as_loaded alone), in with it on
    assert loop_lines(off) == loop_lines(report("sum_as_loaded")), off
    assert len(loop_lines(on)) > len(loop_lines(off)), on


def test_a_reduction_across_warps_shows_barriers_and_shared_traffic_in_the_loop():
    across = shared_lines(report("tile_sums_each_step", "AXIS=0"))
    assert len(across) == 1 and all(n > 0 for n in across[0]), across
    for kernel, *consts in (("tile_sums_each_step", "AXIS=1"), ("sum_as_loaded",)):
        loops = shared_lines(report(kernel, *consts))
        assert loops and all(n == (0, 0, 0) for n in loops), (kernel, loops)


def test_programs_an_sm_by_registers_threads_and_shared_memory():
    sys.path.insert(0, str(ROOT / "scripts"))
    from kernel_sass import programs_per_sm

    # sm_90, 4 warps: 168 registers (5376 a warp) give 3 programs, 176 (5632) only 2; 114688 B of shared memory
    # (+1 KiB reserved) 2 of 228 KiB, 73728 B 3
    assert programs_per_sm(168, 73728, 4, 90) == (3, 3)
    assert programs_per_sm(176, 114688, 4, 90) == (2, 2)
    assert programs_per_sm(161, 0, 4, 90) == (3, 32)          # registers round up to 8 a thread: 168
    assert programs_per_sm(32, 0, 4, 90)[0] == 16               # threads: 2048 an SM
    assert programs_per_sm(128, 65536, 4, 75)[1] is None        # shared memory of an unlisted architecture


def test_the_launch_shared_memory_of_a_pipelined_loop_and_programs_an_sm():
    plain = re.search(r"launch shared memory (\d+) B; programs an SM: (\d+) by registers and threads, (\d+) by "
                      r"shared memory", report("sum_as_loaded"))
    piped = re.search(r"launch shared memory (\d+) B; programs an SM: (\d+) by registers and threads, (\d+) by "
                      r"shared memory", report("sum_pipelined"))
    assert plain and piped
    assert int(piped.group(1)) > int(plain.group(1))            # the pipeline's stages are buffers in shared memory
    for m in (plain, piped):                                     # 228 KiB an SM on sm_90, 1 KiB reserved each
        assert int(m.group(3)) == min(233472 // (int(m.group(1)) + 1024), 32), m.group(0)


def test_not_resident_names_what_keeps_programs_off_an_sm():
    """The probes' residency check: the kernel's binary is loaded first (its register count is only known then),
    and the tighter of the register and shared-memory bounds decides."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from types import SimpleNamespace

    from kernel_sass import not_resident

    def compiled(regs: int, shared: int) -> SimpleNamespace:
        k = SimpleNamespace(n_regs=None, metadata=SimpleNamespace(shared=shared))
        k._init_handles = lambda: setattr(k, "n_regs", regs)
        return k

    assert not_resident(compiled(168, 73728), 4, 90, 3) is None
    assert not_resident(compiled(176, 0), 4, 90, 3) == "176 registers, 0 B shared a program"
    assert not_resident(compiled(128, 114688), 4, 90, 3) == "128 registers, 114688 B shared a program"
    assert not_resident(compiled(128, 65536), 4, 75, 4) is None        # shared memory unknown there: registers only
