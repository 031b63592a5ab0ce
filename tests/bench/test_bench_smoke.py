"""The GPU benchmarks' own CPU modes run end to end and write their results (the scripts keep working)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _run(args: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=280)


def test_quant_decode_smoke(tmp_path):
    out = tmp_path / "q.json"
    proc = _run(["bench/quant_decode.py", "--smoke", "--commit", "test", "--out", str(out)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["errors"] == [] and res["commit"] == "test"
    assert set(res["goals"]) >= {"b1_speedup", "b64_speedup", "multi_lora_over_floor"}


def test_quant_decode_act_order_smoke(tmp_path):
    """--act-order: the 4-bit projections stored in a channel order of their own (down's taken by gate/up's rows,
    as a load does), the engine's decode run on them; --no-kernels leaves the kernel table out."""
    out = tmp_path / "q.json"
    proc = _run(["bench/quant_decode.py", "--smoke", "--act-order", "--no-kernels", "--labels", "int4",
                 "--batches", "1", "--out", str(out)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["errors"] == [] and res["act_order"] is True and "kernels" not in res
    layers = res["dims"]["num_hidden_layers"]
    assert res["act_order_projections"] == 3 * layers, "every projection in its own order, down's taken by gate/up"
    assert res["mlp_ordered_layers"] == layers
    assert res["engine"]["int4"]["base"]["1"]["tpot_ms"] > 0


def test_quant_decode_goals_from_a_run_without_batch_1():
    """A run of some batches (gpu_stages.sh quant-decode-ab: 8, 32, 64) reports the goals it can and names the
    others, instead of dropping every goal at the first missing row."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("quant_decode", ROOT / "bench" / "quant_decode.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    row = lambda ms, over: {"tpot_ms": ms, "tpot_over_floor": over}                       # noqa: E731
    eng = {"bf16": {"base": {"8": row(4.0, 3.0), "64": row(5.0, 3.5)}},
           "int4": {"base": {"8": row(2.0, 2.0), "64": row(4.0, 3.0)}, "distinct_r16_all": {"8": row(3.0, 1.1)}}}
    goals = mod.goals({"engine": eng})
    assert goals["not_run"] == ["batch 1, no adapter, both engines"] and "b1_speedup" not in goals
    assert goals["b64_speedup"] == 1.25 and goals["multi_lora_goal_1.2"] is True
    eng["bf16"]["base"]["1"], eng["int4"]["base"]["1"] = row(6.0, 1.2), row(2.0, 1.5)
    goals = mod.goals({"engine": eng})
    assert goals["not_run"] == [] and goals["b1_speedup"] == 3.0 and goals["b1_over_floor_goal_1.4"] is False


def test_tp_decode_tiny_over_gloo(tmp_path):
    out = tmp_path / "tp.json"
    proc = _run(["-m", "torch.distributed.run", "--nproc-per-node", "2", "bench/tp_decode.py", "--tiny",
                 "--skip-70b", "--batches", "1,4", "--commit", "test", "--out", str(out)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["errors"] == [] and res["all_reduce"] == "gloo"
    assert set(res["configs"]) == {"8b_tp1", "8b_tp2"}
    assert res["tp2_over_tp1_8b"]["base"]["1"]["tpot"] > 0


def test_adapter_swap_tiny_reports_every_repeat(tmp_path):
    out = tmp_path / "swap.json"
    proc = _run(["bench/adapter_swap.py", "--tiny", "--repeats", "2", "--steps", "30", "--num-adapters", "4",
                 "--gap-ms", "5", "--out", str(out)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    run = res["switch_interval_service"]
    assert len(run["repeats"]) == 2 and len(res["p99_ratio_per_repeat"]) == 2
    assert len(res["loads"]) == 2 * 4                            # every repeat's storm loads every adapter
    assert run["quiet"]["num_gaps"] == sum(r["quiet"]["num_gaps"] for r in run["repeats"])   # pooled
    assert res["storm"]["p99_ms"] >= res["storm"]["p90_ms"] >= res["storm"]["p50_ms"] > 0


def test_cold_adapter_burst_small(tmp_path):
    out = tmp_path / "burst.json"
    proc = _run(["bench/cold_adapter_burst.py", "--num", "2", "--rank", "4", "--repeats", "1", "--out", str(out)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    (r,) = res["rounds"]
    assert r["one_after_another_s"] > 0 and r["at_once_s"] > 0


def test_engine_host_step_small(tmp_path):
    out = tmp_path / "host.json"
    proc = _run(["bench/engine_host_step.py", "--num-seqs", "4", "--tokens", "8", "--repeats", "2",
                 "--out", str(out)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert len(res["rounds"]) == 2 and res["host_ms_per_step_best"] > 0
    assert {"schedule", "model", "sample", "advance", "land", "delta", "other", "step"} <= set(
        res["rounds"][0]["ms_per_step"])


def test_step_profile_smoke_and_timeline(tmp_path):
    """The profiler script runs its cases on CPU; its timeline arithmetic (busy, idle, gaps by neighbours)
    is checked on a hand-made trace, since the CPU mode has no GPU timeline."""
    out = tmp_path / "p.json"
    proc = _run(["bench/step_profile.py", "--smoke", "--cases", "base:1,distinct_r16_qkv:2", "--steps", "2",
                 "--bits", "4", "--trace", "5", "--out", str(out)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["bits"] == 4
    assert [(c["case"], c["batch"]) for c in res["cases"]] == [("base", 1), ("distinct_r16_qkv", 2)]
    assert all(c["kernels"] and c["kernels"][0]["us_per_step"] > 0 for c in res["cases"])
    assert all(len(c["trace"]) == 5 and c["trace"][0]["start_us"] == 0.0 for c in res["cases"])

    sys.path.insert(0, str(ROOT / "bench"))
    from step_profile import last_step, timeline

    trace = [("a", 0.0, 10.0), ("b", 5.0, 20.0), ("c", 30.0, 40.0), ("d", 41.0, 50.0), ("c", 80.0, 100.0)]
    tl = timeline(trace, steps=2, top=5)
    assert tl["span_us"] == 50.0 and tl["busy_us"] == 29.5 and tl["idle_us"] == 20.5    # per step: / 2
    assert tl["gaps"][0] == dict(after="d", before="c", us_per_step=15.0, per_step=0.5)
    assert tl["gaps"][1] == dict(after="b", before="c", us_per_step=5.0, per_step=0.5)
    assert len(tl["gaps"]) == 2                                 # the 1 us gap before d is below the 3 us cut
    assert tl["overlap_us"] == 2.5                              # a and b ran side by side for 5 us
    assert last_step(trace[:4], steps=2, first=1) == [dict(kernel="c", start_us=0.0, end_us=10.0)]


def test_step_profile_projection_spans():
    """Per projection of a layer: from the end of the kernel that wrote its x (the latest one that started before
    it, which a dependent launch overlaps) to the projection's end, and its own start to end, over whole layers;
    LoRA launches and the first q/k/v of a step (after the embedding, no norm) are left out."""
    sys.path.insert(0, str(ROOT / "bench"))
    from step_profile import projection_spans

    def k(name, start, end):
        return dict(kernel=name, start_us=start, end_us=end)

    layer = [k("_add_rms_norm_kernel", 0, 2), k("_fused_kernel", 1, 9), k("quant_gemv_kernel", 1.5, 10),
             k("_rope_cache_kernel", 9, 11), k("_paged_decode_kernel", 10, 14), k("quant_gemv_kernel", 12, 20),
             k("_add_rms_norm_kernel", 19, 21), k("quant_gemv_tma_kernel", 20, 45), k("_silu_mul_kernel", 44, 46),
             k("quant_gemv_kernel", 45, 60)]
    first = [k("index_elementwise", -5, -1), k("quant_gemv_kernel", -1, 0)]      # a step's first q/k/v
    trace = first + layer[3:] + [dict(e, start_us=e["start_us"] + 60, end_us=e["end_us"] + 60) for e in layer]
    spans = projection_spans(trace)
    assert spans["qkv"] == dict(from_x_us=8.0, own_us=8.5, layers=1)         # 70 - 62
    assert spans["o"] == dict(from_x_us=6.0, own_us=8.0, layers=2)           # 20 - 14 in both layers
    assert spans["gate_up"] == dict(from_x_us=24.0, own_us=25.0, layers=2)
    assert spans["down"] == dict(from_x_us=14.0, own_us=15.0, layers=2)


def _results(script: str, args: list[str], out: Path) -> dict:
    """Runs a benchmark script with `--out out` and returns what it wrote (its stderr when it failed)."""
    proc = _run([script, *args, "--out", str(out)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_serve_cpu_share_smoke_names_the_services_and_their_cpu(tmp_path):
    res = _results("bench/serve_cpu_share.py", ["--smoke", "--streams", "8", "--tokens", "4", "--seconds", "4",
                                                 "--window", "2"], tmp_path / "share.json")
    roles = {name.split(" (")[0] for name in res["cpu_share"]}
    assert {"gateway-1", "compute", "cache"} <= roles, roles
    assert res["bursts"] >= 1 and res["ttft_ms"]["p50"] > 0
    busy = [share for name, share in res["cpu_share"].items() if name.startswith(("gateway", "compute"))]
    assert all(share > 0 for share in busy), res["cpu_share"]      # they served the bursts


def test_gateway_tokens_smoke_prices_a_token_in_gateway_cpu(tmp_path):
    res = _results("bench/gateway_tokens.py", ["--smoke"], tmp_path / "gw.json")
    assert res["rounds"] >= 1 and res["tokens_per_s"] > 0
    assert res["cpu_share"]["gateway"] > 0 and res["gateway_cpu_us_per_token"] > 0


def test_quant_gemv_probe_smoke(tmp_path):
    """The loads-only probe reads every word of each program's rows (checked against the weight's own sums), in
    its plain loops and through the staged ones (a TMA descriptor's boxes, pipelined pointer loads)."""
    out = tmp_path / "probe.json"
    proc = subprocess.run([sys.executable, "bench/quant_gemv_probe.py", "--smoke", "--out", str(out)], cwd=ROOT,
                          env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert [c["kind"] for c in res["cases"]] == ["plain", "plain", "pipelined", "tma"]
    assert {c["flat"] for c in res["cases"][:2]} == {0, 1} and all("us" in c for c in res["cases"])


def test_quant_layer_probe_smoke(tmp_path):
    """The persistent-step probe reads every word of every layer once and, with its small phases, every KV value,
    in each mode (the script checks both sums; barriers are compiled out on the CPU)."""
    out = tmp_path / "layers.json"
    proc = subprocess.run([sys.executable, "bench/quant_layer_probe.py", "--smoke", "--out", str(out)], cwd=ROOT,
                          env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    cases = json.loads(out.read_text())["cases"]
    modes = ("launches", "launches_early", "persistent", "preload", "preload_split", "stream", "barriers",
             "pipelined")
    assert {(c["mode"], c["small"]) for c in cases} == {(m, s) for m in modes for s in (False, True)}


def test_quant_layer_probe_per_projection_smoke(tmp_path):
    """--per-projection: each projection's loads after a norm, a figure per projection (the norms' own time too);
    with --engine-grids also on pick_config's one-row grids. The script checks that every word was read once (one
    block before the wait, the rest in the loop)."""
    out = tmp_path / "per.json"
    proc = subprocess.run([sys.executable, "bench/quant_layer_probe.py", "--smoke", "--per-projection",
                           "--engine-grids", "--configs", "1,32,2,4,0,1", "--out", str(out)], cwd=ROOT,
                          env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert "cases" in res and res["cases"] == []
    probe, engine = res["per_projection"]
    assert set(probe) >= {"norms_us", "qkv", "o", "gate_up", "down", "block_n", "early_units"}
    assert set(engine["grids"]) == {"qkv", "o", "gate_up", "down"} and "gate_up" in engine


def test_quant_step_arith_smoke(tmp_path):
    """The chain and the persistent step, with the one-row arithmetic and with loads alone: the script checks the
    products against the dequantized weights' (every unit once, its scales and x) and the words' sum."""
    out = tmp_path / "arith.json"
    proc = subprocess.run([sys.executable, "bench/quant_step_arith.py", "--smoke", "--out", str(out)], cwd=ROOT,
                          env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    cases = json.loads(out.read_text())["cases"]
    assert {(c["mode"], c["arith"], c["early_units"]) for c in cases} == {
        (m, a, e) for m in ("chain", "persistent") for a in (False, True) for e in (0, 1)}
    assert all(c["err"] < (1e-2 if c["arith"] else 1.0) for c in cases)


@pytest.mark.parametrize("after_norm", [False, True])
def test_quant_kernel_sweep_smoke(tmp_path, after_norm):
    """The kernel sweep's configs at 16 rows run and match the fp32 reference; with --after-norm x is what an
    RMSNorm wrote (the reference is taken from it) and the configs reading x's sums get them from that norm, whose
    own times are recorded by the sums' width (0: none; 128: the pair-codes configs')."""
    out = tmp_path / "sweep.json"
    proc = _run(["bench/quant_kernel_sweep.py", "--smoke", "--out", str(out)]
                + (["--after-norm"] if after_norm else []))
    assert proc.returncode == 0, proc.stderr[-3000:]
    case = json.loads(out.read_text())["cases"]["smoke/o/16"]
    assert len(case["configs"]) == 5 and all(c["err"] < 1e-2 for c in case["configs"])
    if after_norm:
        assert set(case["norm_us"]) == {"0", "128"}
    else:
        assert "norm_us" not in case


def test_quant_kernel_sweep_defer_smoke(tmp_path):
    """--defer: one-row launches that split K leave their partials and the reader after them (the norm after o,
    SwiGLU after gate/up) sums them; every config's summed output matches the fp32 reference, split or not, and the
    reader's own time on a plain output is recorded."""
    out = tmp_path / "sweep.json"
    proc = _run(["bench/quant_kernel_sweep.py", "--smoke", "--defer", "--out", str(out)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    cases = json.loads(out.read_text())["cases"]
    assert set(cases) == {"smoke_defer/o/1", "smoke_defer/gate_up/1"}
    for case in cases.values():
        assert "reader_us" in case and set(case["norm_us"]) == {"0"}
        assert len(case["configs"]) == 3 and all(c["err"] < 1e-2 for c in case["configs"])
    assert sorted(c["cfg"][2] for c in cases["smoke_defer/o/1"]["configs"]) == [1, 2, 4]


def test_quant_split_cost_smoke(tmp_path):
    """The split-K cost probe times a split launch summing its partials and leaving them to the next kernel (the
    script itself checks that the partials sum to the output)."""
    out = tmp_path / "split.json"
    proc = _run(["bench/quant_split_cost.py", "--smoke", "--commit", "test", "--out", str(out)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    case = res["cases"]["smoke"]
    assert case["config"][1] == 2 and case["reduced_us"] > 0 and case["unreduced_us"] > 0
    assert set(res["layer"]) == {"reduced_us", "unreduced_us", "saving_ms_a_token"}


def test_lora_rank_pad_smoke(tmp_path):
    """The rank A/B's script times every case (both launch paths) and keeps an earlier run's rows ahead of its own."""
    out, earlier = tmp_path / "rank.json", tmp_path / "earlier.json"
    earlier.write_text(json.dumps({"rows": [{"kernels": "tree", "us": 1.0}] * 3}))
    proc = _run(["bench/lora_rank_pad.py", "--smoke", "--commit", "test", "--out", str(out), "--label", "other",
                 "--merge", str(earlier)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["commit"] == "test" and [r["kernels"] for r in res["rows"]] == ["tree"] * 3 + ["other"] * 10
    rows = res["rows"][3:]
    assert {(r["rank"], r["max_rank"]) for r in rows} == {(16, 16), (16, 64), (16, 256), (64, 64), (64, 256)}
    assert {r["path"] for r in rows} == {"fused", "shrink+expand"} and all(r["us"] > 0 for r in rows)


def test_lora_step_sweep_smoke(tmp_path):
    """The launch-configuration sweep times every launch kind of a step, shrink and expand, at its default and the
    focused variations; a variation the kernel refuses is recorded as an error, not a time."""
    out = tmp_path / "sweep.json"
    proc = _run(["bench/lora_step_sweep.py", "--smoke", "--focused", "--cases", "16:64", "--commit", "test",
                 "--out", str(out)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    timed = {(r["launch"], r["kernel"], r["variant"]) for r in rows if r.get("us", 0) > 0}
    for launch in ("qkv", "o", "gate_up", "down"):
        for kernel in ("shrink", "expand"):
            assert (launch, kernel, "default") in timed and (launch, kernel, "BLOCK_R=16" if kernel == "expand"
                                                             else "warps=2") in timed
    assert all("us" in r or "error" in r for r in rows) and len(rows) == 4 * (5 + 7)


def test_one_row_config_ab_replaces_only_the_named_shapes_one_row_choice(monkeypatch):
    """bench/one_row_config_ab.py: the named 8B shape's one-row config takes the given fields (and its split partials
    and sums follow, as the engine asks pick_config each call); other rows and shapes keep pick_config's choice."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("one_row_config_ab", ROOT / "bench" / "one_row_config_ab.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    qm = mod.quant_matmul
    monkeypatch.setattr(qm, "pick_config", qm.pick_config)         # undone after the test
    before = {t: qm.pick_config(t, 28672, 4096, 4, 132, 128) for t in (1, 8)}
    down = qm.pick_config(1, 4096, 14336, 4, 132, 128)
    mod.patch(mod.parse("gate_up=64,16,0,8"))
    got = qm.pick_config(1, 28672, 4096, 4, 132, 128)
    assert (got.block_n, got.split_k, got.tma_stages, got.num_warps) == (64, 16, 0, 8)
    assert got.pair_codes == before[1].pair_codes                  # the rest of the choice kept
    assert qm.pick_config(8, 28672, 4096, 4, 132, 128) == before[8]
    assert qm.pick_config(1, 4096, 14336, 4, 132, 128) == down
    mod.patch(mod.parse("gate_up=128,4,3,4,1"))
    got = qm.pick_config(1, 28672, 4096, 4, 132, 128)
    assert (got.tma_stages, got.scales_ahead) == (3, True) and not before[1].scales_ahead
    with pytest.raises(SystemExit):
        mod.parse("lm_head=64,1,0")
