"""bench/quant_gemv_stalls.py's reading of the profiler's output: stall reasons, loops, and the load a hot line
waits for (around a loop's back edge), on a small made-up listing."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("quant_gemv_stalls", ROOT / "bench" / "quant_gemv_stalls.py")
stalls = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(stalls)

HEAD = ('"Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)",'
        '"# Samples","Instructions Executed","stall_barrier","stall_long_sb","stall_selected",'
        '"stall_long_sb (Not Issued)"')
# (address, text, long_sb samples, barrier samples, selected samples)
LISTING = [
    (0x00, "LDG.E.128 R4, desc[UR4][R2.64]", 0, 0, 1),
    (0x10, "IMAD.SHL.U32 R8, R4, 0x40, RZ", 30, 0, 2),       # loop start: R4 comes from the load at 0x40
    (0x20, "LDS.64 R10, [R12]", 0, 12, 1),
    (0x30, "FADD R14, R10, R8", 0, 0, 3),
    (0x40, "@!P1  LDG.E.128 R4, desc[UR4][R20.64]", 0, 0, 1),
    (0x50, "FADD R15, R14, R9", 0, 0, 2),
    (0x60, "@P0   BRA 0x10", 0, 0, 1),
    (0x70, "EXIT", 0, 0, 0),
]


def _csv() -> str:
    lines = ['"Kernel Name","quant_gemv_kernel",', HEAD]
    for addr, text, lsb, bar, sel in LISTING:
        lines.append(f'"{addr:#x}","      {text}","{lsb + bar + sel}","{lsb + bar}","{lsb + bar + sel}","8",'
                     f'"{bar}","{lsb}","{sel}","{lsb}"')
    return "==PROF== Connected\nQuantMatmulConfig(block_n=128, block_m=1, split_k=1, num_warps=4)\n" + "\n".join(lines)


def _main(monkeypatch, *args: str) -> None:
    monkeypatch.setattr(sys, "argv", ["quant_gemv_stalls.py", *args])
    stalls.main()


def test_source_table_and_loops():
    instrs = stalls.parse_source(_csv())
    assert [i["addr"] for i in instrs] == [a for a, *_ in LISTING]
    assert instrs[1]["reasons"] == {"long_sb": 30, "selected": 2} and instrs[1]["samples"] == 32
    assert stalls.loops(instrs) == [(1, 6)]


def test_waited_load_across_the_back_edge():
    instrs = stalls.parse_source(_csv())
    # 0x10 reads R4: the nearest writer, going back around the loop, is the 128-bit load at 0x40 (R4..R7)
    assert stalls.waited_load(instrs, 1) == {"load_addr": "0x40", "load": "@!P1  LDG.E.128 R4, desc[UR4][R20.64]",
                                             "distance": 3}
    # 0x30 reads R10 (the shared load just before) and R8: the nearest writer is a load
    assert stalls.waited_load(instrs, 3) == {"load_addr": "0x20", "load": "LDS.64 R10, [R12]", "distance": 1}
    # 0x50 reads R14 (an add's) and R9 (written nowhere in the loop): no load
    assert stalls.waited_load(instrs, 5) is None


def test_written_registers_of_wide_loads():
    assert stalls._written("LDG.E.128", ["R4", "desc[UR4][R2.64]"]) == {4, 5, 6, 7}
    assert stalls._written("LDS.64", ["R10", "[R12]"]) == {10, 11}
    assert stalls._written("STS.64", ["[R1]", "R2"]) == set()
    assert stalls._read("STS.64", ["[R1]", "R2"]) == {1, 2}


def test_summary_and_metrics():
    metrics = stalls.parse_metrics(
        "    gpu__time_duration.sum                      us        29.95\n"
        "    smsp__inst_executed.sum                   inst   11,638,144\n"
        "    smsp__average_warps_issue_stalled_wait_per_issue_active.ratio   inst   0.53\n"
        "    ---------------------------------------- ----------- ------------\n")
    assert metrics == {"gpu__time_duration.sum": 29.95, "smsp__inst_executed.sum": 11638144.0,
                       "smsp__average_warps_issue_stalled_wait_per_issue_active.ratio": 0.53}
    s = stalls.summarize(stalls.parse_source(_csv()), metrics, top=2)
    assert s["samples"] == 53 and list(s["reasons_share"]) == ["long_sb", "barrier", "selected"]
    assert s["reasons_share"]["long_sb"] == pytest.approx(30 / 53, abs=1e-4)
    assert [h["addr"] for h in s["hot"]] == ["0x10", "0x20"]
    assert s["hot"][0]["waits_for"]["distance"] == 3 and s["hot"][1]["waits_for"] is None
    assert s["loops"] == [{"first": "0x10", "last": "0x60", "instructions": 6}]


def test_parse_mode_writes_the_summary(tmp_path, monkeypatch):
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "gate_up_source.csv").write_text(_csv())
    (raw / "gate_up_metrics.txt").write_text("    gpu__time_duration.sum    us    29.95\n")
    (raw / "device.txt").write_text("Some GPU\n")
    out = tmp_path / "s.json"
    _main(monkeypatch, "--parse", str(raw), "--shapes", "gate_up", "--out", str(out))
    res = json.loads(out.read_text())
    assert res["device"] == "Some GPU" and res["shapes"]["gate_up"]["config"] == [128, 1, 1, 4]
    assert res["shapes"]["gate_up"]["metrics"]["gpu__time_duration.sum"] == 29.95


def test_profiling_without_the_profiler_says_so(tmp_path, monkeypatch):
    monkeypatch.setattr(stalls.shutil, "which", lambda name: None)
    with pytest.raises(SystemExit, match="not on the PATH"):
        stalls.profile("gate_up", tmp_path)


def test_a_refusing_profiler_is_reported(monkeypatch):
    class Done:
        returncode, stdout, stderr = 0, "==ERROR== ERR_NVGPUCTRPERM - no permission to the counters\n", ""
    monkeypatch.setattr(stalls.subprocess, "run", lambda *a, **k: Done())
    with pytest.raises(SystemExit, match="ERR_NVGPUCTRPERM"):
        stalls._ncu(["ncu", "--metrics", "x"])


def test_parse_mode_with_rows_reads_their_files(tmp_path, monkeypatch):
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "down_t8_source.csv").write_text(_csv().replace("quant_gemv_kernel", "quant_mma_kernel")
                                            .replace("block_m=1", "block_m=16"))
    (raw / "down_t8_metrics.txt").write_text("    gpu__time_duration.sum    us    12.5\n")
    out = tmp_path / "s.json"
    _main(monkeypatch, "--parse", str(raw), "--shapes", "down", "--rows", "8", "--out", str(out))
    res = json.loads(out.read_text())
    assert res["rows"] == 8 and res["command"].endswith("--rows 8")
    assert res["shapes"]["down"]["kernel"] == "quant_mma_kernel" and res["shapes"]["down"]["config"][1] == 16


def test_rows_beyond_the_tiles_are_refused(tmp_path, monkeypatch, capsys):
    with pytest.raises(SystemExit):
        _main(monkeypatch, "--rows", "128", "--out", str(tmp_path / "s.json"))
    assert "--rows: 1 to 64" in capsys.readouterr().err


def test_the_profiled_kernel_is_the_one_pick_config_runs():
    from kernels.quant_matmul import pick_config
    for n, k in stalls.SHAPES.values():
        for rows in (1, 2, 8, 64):
            one_row = pick_config(rows, n, k, 4, 132, 128).block_m == 1
            assert stalls.KERNELS[rows == 1] == stalls.KERNELS[one_row]


def test_async_dots_profile_the_ring_kernel_and_keep_their_own_files(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(stalls.shutil, "which", lambda name: "/usr/bin/ncu")
    monkeypatch.setattr(stalls, "_ncu", lambda args: calls.append(args) or "")
    stalls.profile("down", tmp_path, 8, async_dots=True)
    assert all(a[a.index("--kernel-name") + 1] == stalls.ASYNC_KERNELS and a[-1] == "--async-dots" for a in calls)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["down_t8_async_metrics.txt", "down_t8_async_source.csv"]
    (tmp_path / "down_t8_async_source.csv").write_text(
        _csv().replace("quant_gemv_kernel", "quant_wgmma_kernel").replace("block_m=1", "block_m=8"))
    out = tmp_path / "s.json"
    _main(monkeypatch, "--parse", str(tmp_path), "--shapes", "down", "--rows", "8", "--async-dots", "--out", str(out))
    res = json.loads(out.read_text())
    assert res["async_dots"] and res["command"].endswith("--rows 8 --async-dots")
    assert res["shapes"]["down"]["kernel"] == "quant_wgmma_kernel" and res["shapes"]["down"]["config"][1] == 8


def test_async_dots_launch_what_pick_config_picks_with_them():
    from kernels.quant_matmul import pick_config
    n, k = stalls.SHAPES["gate_up"]
    assert pick_config(8, n, k, 4, 132, 128, async_dots=True).ring > 0       # the ring kernel at 8 rows
    assert "wgmma" in stalls.ASYNC_KERNELS and "gemv" in stalls.ASYNC_KERNELS   # one row keeps its kernel
