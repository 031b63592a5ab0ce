"""bench/soak.py: its arguments and the figures it adds up (the scenarios run in test_soak/test_faults)."""
from __future__ import annotations

import soak
import soak_scenarios as sc


def test_defaults_are_the_ci_sized_soak_and_every_scenario():
    args = soak.parse_args([])
    assert args.streams == 1000 and args.pool_adapters < args.num_adapters
    assert set(args.scenarios.split(",")) == {"streams", "small_pool", "stalled_reader", "kill_cache",
                                              "restart_redis", "kill_compute"}
    flags = soak.soak_flags(args)
    assert flags[flags.index("--max-resident-adapters") + 1] == str(args.pool_adapters)
    assert "--kv-cache-bytes" not in soak.soak_flags(soak.parse_args(["--kv-cache-bytes", "0"]))


def test_a_scenario_that_raises_is_a_problem_and_the_run_goes_on():
    res = {"scenarios": {}, "leaks_found": 0, "problems": []}

    def broken():
        raise RuntimeError("boom")
    soak.run_scenario(res, "kill_cache", broken, lambda: None)
    soak.run_scenario(res, "streams", lambda: {"leaks": {"compute-0.kv_blocks_used": 3, "x": 0},
                                               "problems": ["leak: compute-0.kv_blocks_used = 3"]}, lambda: None)
    assert res["leaks_found"] == 1
    assert res["problems"][0].startswith("kill_cache: the scenario failed: RuntimeError('boom')")
    assert res["problems"][1] == "streams: leak: compute-0.kv_blocks_used = 3"


def test_plans_mix_cancels_deadlines_and_adapters_and_expect_the_right_endings():
    plans = sc.make_plans(2000, [None, "a", "b"], 16, num_prompts=8, cancel_frac=0.2, deadline_frac=0.2, seed=3)
    cancels = [p for p in plans if p.cancel_after is not None]
    deadlines = [p for p in plans if p.deadline_s is not None]
    assert 300 < len(cancels) < 500 and 300 < len(deadlines) < 500
    assert all(1 <= p.cancel_after < 16 for p in cancels)
    assert {p.lora for p in plans} == {None, "a", "b"}
    assert sc.expected_codes(cancels[0]) == {"CANCELLED"}
    assert sc.expected_codes(deadlines[0]) == {"OK", "DEADLINE_EXCEEDED"}
    full = next(p for p in plans if p.cancel_after is None and p.deadline_s is None)
    assert sc.expected_codes(full) == {"OK"}
    # a full stream that got only part of its answer, or other tokens, is a problem
    problems: list[str] = []
    alone = {(full.prompt, full.lora): [5, 6, 7]}
    sc.check_results([sc.Result(full, "OK", tokens=[5, 6]), sc.Result(full, "OK", tokens=[5, 9, 7]),
                      sc.Result(full, "CANCELLED"), sc.Result(full, "OK", tokens=[5, 6, 7])], alone, problems)
    assert len(problems) == 3, problems
