"""bench/serve_load.py: its figures from timelines, and the whole script on a tiny model (--smoke)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

from serve_load import case_requests, parse_args, poisson_offsets, serve_argv  # noqa: E402
from serve_load_stats import percentiles, ratios, summarize  # noqa: E402


def timeline(sent: float, messages: list[tuple[float, int]], finish: str = "length", error: str = ""):
    return SimpleNamespace(sent=sent, messages=messages, finish_reason=finish, error=error)


def test_a_message_of_k_tokens_after_a_gap_counts_k_samples_of_gap_over_k():
    # first token at 10 ms, then one message of 3 tokens 30 ms later, then 1 token 10 ms later
    r = summarize([timeline(0.0, [(0.010, 1), (0.040, 3), (0.050, 1)])])
    assert r["output_tokens"] == 5
    assert r["ttft_ms"]["p50"] == pytest.approx(10.0)
    assert r["e2e_ms"]["p50"] == pytest.approx(50.0)
    assert r["itl_ms"]["p50"] == pytest.approx(10.0) and r["itl_ms"]["p99"] == pytest.approx(10.0)
    assert r["itl_message_ms"]["p50"] == pytest.approx(20.0)       # raw gaps 30 and 10 ms
    assert r["itl_message_ms"]["p99"] == pytest.approx(29.8)
    assert r["tpot_ms"]["p50"] == pytest.approx(10.0)
    assert r["tokens_per_message"] == pytest.approx(5 / 3)
    assert r["output_tok_per_s"] == pytest.approx(5 / 0.050)


def test_decode_rate_counts_only_tokens_after_every_request_started():
    a = timeline(0.0, [(0.010, 1), (0.020, 1), (0.030, 1)])
    b = timeline(0.0, [(0.020, 1), (0.030, 1), (0.040, 1)])
    r = summarize([a, b])
    assert r["decode_tok_per_s"] == pytest.approx(3 / 0.020)   # a@30, b@30, b@40 after b's first at 20
    assert r["num_failed"] == 0


def test_failed_requests_are_counted_not_measured():
    r = summarize([timeline(0.0, [(0.01, 1), (0.02, 1)]), timeline(0.0, [], "error", "UNAVAILABLE: down")])
    assert r["num_failed"] == 1 and r["errors"] == ["UNAVAILABLE: down"]
    assert r["output_tokens"] == 2


def test_percentiles_interpolate_and_scale():
    p = percentiles([0.001 * i for i in range(1, 101)])
    assert p["p50"] == pytest.approx(50.5) and p["p99"] == pytest.approx(99.01) and p["mean"] == pytest.approx(50.5)
    assert percentiles([])["p50"] is None


def test_ratios_are_one_when_served_matches_the_engine_and_lower_when_slower():
    fig = dict(output_tok_per_s=100.0, decode_tok_per_s=120.0, itl_ms=dict(p50=2.0, p99=4.0))
    slow = dict(output_tok_per_s=50.0, decode_tok_per_s=60.0, itl_ms=dict(p50=4.0, p99=16.0))
    assert ratios(fig, fig) == dict(output_tok_per_s=1.0, decode_tok_per_s=1.0, itl_p50=1.0, itl_p99=1.0)
    assert ratios(slow, fig) == dict(output_tok_per_s=0.5, decode_tok_per_s=0.5, itl_p50=0.5, itl_p99=0.25)


def test_the_pools_largest_rank_defaults_to_the_adapters_and_reaches_the_server(tmp_path):
    args = parse_args(["--ranks", "8,16"])
    assert args.max_lora_rank == 16
    args = parse_args(["--ranks", "8,16", "--max-lora-rank", "256"])
    argv = serve_argv(args, "", tmp_path)
    assert argv[argv.index("--max-lora-rank") + 1] == "256"
    with pytest.raises(SystemExit):
        parse_args(["--ranks", "8,64", "--max-lora-rank", "32"])


def test_workloads_assign_adapters_and_poisson_arrivals_grow():
    prompts = [[1, 2], [3, 4]]
    names = ["a000", "a001", "a002"]
    assert [r.lora for r in case_requests("base", prompts, names, [0.0] * 4)] == [None] * 4
    assert [r.lora for r in case_requests("shared", prompts, names, [0.0] * 4)] == ["a000"] * 4
    assert [r.lora for r in case_requests("distinct", prompts, names, [0.0] * 4)] == names + ["a000"]
    offs = poisson_offsets(2000, rate=100.0, seed=1)
    assert offs[0] == 0.0 and all(b > a for a, b in zip(offs, offs[1:]))
    assert offs[-1] / len(offs) == pytest.approx(0.01, rel=0.1)   # mean gap 1 / rate


@pytest.mark.slow
@pytest.mark.parametrize("steps", ["plain", "quantized_sampled"])
def test_smoke_run_serves_every_case_and_compares_with_the_engine(tmp_path, steps):
    """"plain": the CPU's default steps; "quantized_sampled": both sides on a 4-bit GPTQ act-order copy of the tiny
    model (--quantize-bits, kept quantized, each input's channels in a random order), every request with a
    temperature and top-p, on overlapped steps (--async-scheduling, as a GPU serves by default)."""
    out = tmp_path / "serve_load.json"
    flags = {"plain": [],
             "quantized_sampled": ["--quantize-bits", "4", "--quantize-group-size", "32", "--quantization", "keep",
                                   "--quantize-format", "gptq", "--act-order-seed", "1",
                                   "--async-scheduling", "--temperature", "0.8", "--top-p", "0.9"]}[steps]
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "serve_load.py"), "--smoke", "--out", str(out), *flags],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["errors"] == [] and res["served_exit_code"] == 0
    assert "model_s" in res["served_start_stages"] and res["served_start_stages"]["compute_serving_s"] > 0
    assert res["flags"]["output_len"] == 8 and len(res["adapters"]) == 4
    sampled = steps == "quantized_sampled"
    assert (res["flags"]["temperature"], res["flags"]["top_p"]) == ((0.8, 0.9) if sampled else (0.0, 1.0))
    assert res["flags"]["async_scheduling"] is (True if sampled else None)
    if sampled:
        assert res["model"].endswith("model-w4g32-gptq-ao1") and res["quantized_from"].endswith("tiny-model")
        assert json.loads((Path(res["model"]) / "config.json").read_text())["quantization_config"]["desc_act"]
    assert res["first_request"]["output_tokens"] == 8 and res["adapters_first_use"]["num_requests"] == 4
    for workload in ("base", "shared", "distinct"):
        for conc in ("1", "4"):
            served = res["served"][workload]["burst"][conc]
            assert served["num_failed"] == 0 and served["output_tokens"] == int(conc) * 8
            assert res["served"][workload]["poisson"][conc]["output_tokens"] == 2 * int(conc) * 8
            assert res["engine"][workload][conc]["output_tokens"] == int(conc) * 8
            poisson = res["engine_poisson"][workload][conc]        # the served case's arrivals, on the engine
            assert poisson["output_tokens"] == 2 * int(conc) * 8 and poisson["max_in_flight"] == int(conc)
            assert poisson["rate_per_s"] == res["served"][workload]["poisson"][conc]["rate_per_s"]
            for side in (served, res["engine"][workload][conc]):   # step host times, served from its trace
                assert side["num_steps"] >= 8 and side["step_ms"]["p50"] >= side["launch_ms"]["p50"] > 0
            assert res["ratios"][workload][conc]["output_tok_per_s"] > 0
            assert served["itl_ms"]["p99"] >= served["itl_ms"]["p50"] > 0
    for workload in ("base", "distinct"):                         # idle TTFT: 16 short requests, one at a time
        for side in (res["idle_ttft"][workload], res["engine_idle_ttft"][workload]):
            assert side["num_requests"] == 16 and side["num_failed"] == 0 and side["output_tokens"] == 32
            assert side["ttft_ms"]["p90"] >= side["ttft_ms"]["p50"] > 0
