"""Overlapped steps (`EngineConfig.async_scheduling`): decode step N+1 is queued before step N's tokens are
read back. Every request must get the same tokens and the same ending as with plain steps: greedy and
seeded sampling, adapters, requests joining mid-way, EOS and stop ids and stop strings met on a token
whose successor is already being computed, length limits, aborts, and preemption when KV blocks run out."""
from __future__ import annotations

import copy

import pytest
import torch

from compute_service.engine import EngineConfig, LLMEngine, SamplingParams
from helpers import TINY_DIMS, add_peft_adapters, peft_adapter_to_converted

V = TINY_DIMS["vocab_size"]


class CharTokenizer:
    """Token t decodes to one letter."""

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(ord("a") + t % 26) for t in ids)


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, V, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def qwen_with_adapters(tiny_models):
    model, folder = tiny_models["qwen2"]
    peft = add_peft_adapters(copy.deepcopy(model), {"x": dict(r=8, target_modules=["v_proj", "up_proj"]),
                                                    "y": dict(r=4, target_modules=["q_proj", "down_proj"])})
    return folder, {k: peft_adapter_to_converted(peft, k) for k in ("x", "y")}


def run(folder, adapters, *, overlap: bool, kv_bytes: int, requests: dict, joins: dict, aborts: dict):
    """request id -> (tokens, finish reason); and how many steps ended with a step in flight."""
    engine = LLMEngine(EngineConfig(model=str(folder), block_size=4, max_model_len=64, kv_cache_bytes=kv_bytes,
                                    max_num_batched_tokens=32, max_loras=2, async_scheduling=overlap))
    engine.tokenizer = CharTokenizer()
    for key, adapter in adapters.items():
        engine.add_adapter(key, adapter)
    tokens: dict[str, list[int]] = {}
    endings: dict[str, str] = {}
    step, overlapped = 0, 0
    while step < 500:
        for rid, (p, params, key) in requests.items():
            if joins.get(rid, 0) == step:
                engine.add_request(rid, p, params, adapter_key=key)
        for rid, at in aborts.items():
            if at == step:
                engine.abort_request(rid)
        if not engine.has_unfinished() and step > max(joins.values()):
            break
        for d in engine.step():
            tokens.setdefault(d.request_id, []).extend(d.new_token_ids)
            assert d.request_id not in endings, f"{d.request_id}: a delta after its last"
            if d.finished:
                endings[d.request_id] = d.finish_reason
                assert d.num_output_tokens == len(tokens[d.request_id])
        overlapped += engine.in_flight
        step += 1
    assert not engine.has_unfinished() and not engine.in_flight
    stats = engine.stats()
    assert stats.num_kv_blocks_used == 0 and stats.num_running == stats.num_waiting == 0
    assert engine.slots.pin_count("x") == engine.slots.pin_count("y") == 0
    return {rid: (tokens.get(rid, []), endings.get(rid)) for rid in requests}, overlapped, stats.num_preemptions


def workload(free: dict[str, list[int]] | None = None):
    """12 requests; with `free` (each request's tokens without stops), stops placed on those tokens."""
    reqs = {}
    for i in range(12):
        seed = None if i % 3 == 0 else 500 + i
        temp = 0.0 if i % 3 == 0 else 0.9
        stop_ids, stop = [], []
        if free is not None and i in (1, 4):
            stop_ids = [free[f"r{i}"][5]]             # stops on its 6th token (or earlier, where it repeats)
        if free is not None and i == 7:
            stop = [CharTokenizer().decode(free["r7"])[3:5]]   # a string across two tokens
        params = SamplingParams(max_tokens=6 + 3 * (i % 5), temperature=temp, seed=seed, top_k=20 if i % 4 == 1 else 0,
                                top_p=0.9 if i % 4 == 2 else 1.0, ignore_eos=i % 2 == 0,
                                stop_token_ids=stop_ids, stop=stop)
        reqs[f"r{i}"] = (prompt(5 + 2 * i, i), params, [None, "x", "y"][i % 3])
    joins = {f"r{i}": (0 if i < 6 else 2 + 3 * (i - 6)) for i in range(12)}
    return reqs, joins


@pytest.mark.parametrize("kv_bytes", [1 << 22, 2048 * 24], ids=["roomy", "preempting"])
def test_overlapped_steps_give_every_request_the_same_tokens_and_ending(qwen_with_adapters, kv_bytes):
    folder, adapters = qwen_with_adapters
    reqs, joins = workload()
    free, _, _ = run(folder, adapters, overlap=False, kv_bytes=1 << 22, requests=reqs, joins=joins, aborts={})
    reqs, joins = workload({rid: toks for rid, (toks, _) in free.items()})
    want, _, _ = run(folder, adapters, overlap=False, kv_bytes=kv_bytes, requests=reqs, joins=joins, aborts={})
    got, overlapped, preempted = run(folder, adapters, overlap=True, kv_bytes=kv_bytes, requests=reqs,
                                     joins=joins, aborts={})
    assert got == want
    assert {want[r][1] for r in ("r1", "r4", "r7")} == {"stop"} and overlapped > 5
    if kv_bytes < 1 << 22:
        assert preempted > 0


def test_aborts_during_overlapped_steps_end_the_request_once(qwen_with_adapters):
    folder, adapters = qwen_with_adapters
    reqs, joins = workload()
    aborts = {"r2": 3, "r5": 4, "r9": 12}
    want, _, _ = run(folder, adapters, overlap=False, kv_bytes=1 << 22, requests=reqs, joins=joins, aborts={})
    got, _, _ = run(folder, adapters, overlap=True, kv_bytes=1 << 22, requests=reqs, joins=joins, aborts=aborts)
    for rid, (toks, ending) in got.items():
        if rid in aborts:
            assert ending == "abort" and toks == want[rid][0][: len(toks)]
        else:
            assert (toks, ending) == want[rid]


def test_logits_callers_and_length_limits_read_the_step_in_flight_first(tiny_models):
    folder = tiny_models["llama"][1]
    engine = LLMEngine(EngineConfig(model=str(folder), block_size=4, max_model_len=24, async_scheduling=True))
    engine.add_request("long", prompt(10, 1), SamplingParams(max_tokens=100, temperature=0, ignore_eos=True))
    engine.add_request("short", prompt(4, 2), SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    out: dict[str, list] = {}
    for _ in range(3):
        for d in engine.step():
            out.setdefault(d.request_id, []).append(d)
    assert engine.in_flight
    deltas, logits = engine.step_with_logits()     # lands the step in flight, then runs one of its own
    assert not engine.in_flight and set(logits) <= {"long", "short"}
    for d in deltas:
        out.setdefault(d.request_id, []).append(d)
    while engine.has_unfinished():
        for d in engine.step():
            out.setdefault(d.request_id, []).append(d)
    short = [t for d in out["short"] for t in d.new_token_ids]
    long = [t for d in out["long"] for t in d.new_token_ids]
    assert len(short) == 3 and out["short"][-1].finish_reason == "length"
    assert len(long) == 24 - 10 and out["long"][-1].finish_reason == "length"     # max_model_len


@pytest.mark.gpu
def test_overlapped_decode_graphs_on_cuda_give_the_same_tokens(tiny_models):
    """On CUDA the overlapped steps replay the decode graphs with their input ids copied on the device from
    the step in flight. Base model, fp32, stops by length only (so every step has the same batch as with
    plain steps, and the same graphs): the tokens must be equal, greedy and seeded."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    folder = tiny_models["llama"][1]
    requests = {f"r{i}": (prompt(4 + 3 * i, 50 + i),
                          SamplingParams(max_tokens=5 + 4 * (i % 4), temperature=0.0 if i % 2 else 0.8,
                                         seed=900 + i, top_k=0 if i % 3 else 12, ignore_eos=True), None)
                for i in range(10)}
    joins = {f"r{i}": (0 if i < 5 else 3 + 2 * (i - 5)) for i in range(10)}

    def run_cuda(overlap: bool):
        engine = LLMEngine(EngineConfig(model=str(folder), device="cuda", dtype="float32", block_size=4,
                                        max_model_len=64, max_num_seqs=16, async_scheduling=overlap))
        tokens: dict[str, list[int]] = {}
        step, overlapped = 0, 0
        while step < 300 and (engine.has_unfinished() or step <= max(joins.values())):
            for rid, (p, params, _) in requests.items():
                if joins[rid] == step:
                    engine.add_request(rid, p, params)
            for d in engine.step():
                tokens.setdefault(d.request_id, []).extend(d.new_token_ids)
            overlapped += engine.in_flight
            step += 1
        assert engine.runner.num_graph_steps > 0 and engine.stats().num_kv_blocks_used == 0
        return tokens, overlapped

    plain, _ = run_cuda(False)
    overlapped, n = run_cuda(True)
    assert n > 5 and overlapped == plain
    assert all(len(overlapped[r]) == requests[r][1].max_tokens for r in requests)
