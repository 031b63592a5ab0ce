"""LLMEngine behaviour a caller relies on: validation, abort, stops, adapter gating, preemption, seeds."""
from __future__ import annotations

import copy

import pytest
import torch

from compute_service.engine import EngineConfig, InvalidRequestError, LLMEngine, SamplingParams
from helpers import TINY_DIMS, add_peft_adapters, peft_adapter_to_converted

V = TINY_DIMS["vocab_size"]
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, V, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(params=["plain", "overlapped"])
def steps(request) -> str:
    """Every behaviour here holds with plain steps and with overlapped ones (`async_scheduling`)."""
    return request.param


@pytest.fixture
def engine(tiny_models, steps) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(tiny_models["llama"][1]), block_size=4, max_model_len=64,
                                  async_scheduling=steps == "overlapped"))


def drain(engine: LLMEngine) -> dict[str, list]:
    """request id -> list of deltas until nothing is left."""
    out: dict[str, list] = {}
    while engine.has_unfinished():
        for d in engine.step():
            out.setdefault(d.request_id, []).append(d)
    return out


def test_bad_requests_are_refused_with_a_reason(engine):
    with pytest.raises(InvalidRequestError, match="empty"):
        engine.add_request("x", [], GREEDY)
    with pytest.raises(InvalidRequestError, match="max_model_len is 64"):
        engine.add_request("x", prompt(64, 0), GREEDY)
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        engine.add_request("x", [1, V + 5], GREEDY)
    with pytest.raises(InvalidRequestError, match="tokenizer"):
        engine.add_request("x", [1, 2], SamplingParams(stop=["\n"]))
    engine.add_request("x", [1, 2], GREEDY)
    with pytest.raises(InvalidRequestError, match="already"):
        engine.add_request("x", [3], GREEDY)
    assert engine.stats().num_waiting == 1


def test_deltas_add_up_and_length_finish(engine):
    engine.add_request("r", prompt(10, 1), SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    deltas = drain(engine)["r"]
    assert [len(d.new_token_ids) for d in deltas] == [1] * 5
    last = deltas[-1]
    assert last.finished and last.finish_reason == "length"
    assert (last.num_prompt_tokens, last.num_output_tokens) == (10, 5)
    assert not any(d.finished for d in deltas[:-1])


def test_routed_requests_skip_the_outputs_but_lose_no_token(engine):
    """A request added with a route gets its plain one-token deltas as `engine.routed` sequences (no
    `RequestOutput`), its last delta as an output; a request without one gets every delta as an output.
    Both see the same tokens as the same request run alone."""
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    p_routed, p_plain = prompt(7, 2), prompt(5, 3)
    engine.add_request("routed", p_routed, params, route="its route")
    engine.add_request("plain", p_plain, params)
    tokens: dict[str, list[int]] = {"routed": [], "plain": []}
    routed_steps = outputs_of_routed = 0
    while engine.has_unfinished():
        for d in engine.step():
            tokens[d.request_id] += d.new_token_ids
            outputs_of_routed += d.request_id == "routed"
        for seq in engine.routed:
            assert seq.request_id == "routed" and seq.route == "its route" and not seq.is_finished
            tokens["routed"].append(seq.token_ids[-1])
            routed_steps += 1
    assert routed_steps == 5 and outputs_of_routed == 1            # the last token comes as the output
    for rid, p in (("routed", p_routed), ("plain", p_plain)):
        alone = LLMEngine(engine.config, engine.loaded)
        assert tokens[rid] == alone.generate([p], params)[0]


def test_abort_frees_blocks_and_reports_once(engine):
    engine.add_request("a", prompt(20, 2), GREEDY)
    engine.add_request("b", prompt(6, 3), GREEDY)
    engine.step()
    assert engine.stats().num_kv_blocks_used > 0
    assert engine.abort_request("a") and not engine.abort_request("nope")
    used_b = len(engine.scheduler.get("b").block_table)
    assert engine.stats().num_kv_blocks_used == used_b
    deltas = engine.step()
    aborted = [d for d in deltas if d.request_id == "a"]
    assert len(aborted) == 1 and aborted[0].finished and aborted[0].finish_reason == "abort"
    drain(engine)
    assert engine.stats().num_kv_blocks_used == 0 and not engine.has_unfinished()


def test_stop_token_ids_and_stop_strings(engine):
    engine.add_request("free", prompt(7, 4), GREEDY)
    free = [t for d in drain(engine)["free"] for t in d.new_token_ids]
    stop_at = 3                                 # stop on the 4th generated token
    engine.add_request("ids", prompt(7, 4), SamplingParams(max_tokens=8, temperature=0, ignore_eos=True,
                                                           stop_token_ids=[free[stop_at]]))
    got = [t for d in drain(engine)["ids"] for t in d.new_token_ids]
    assert got == free[: free.index(free[stop_at]) + 1]

    class CharTokenizer:                        # token t decodes to one letter
        def decode(self, ids: list[int]) -> str:
            return "".join(chr(ord("a") + t % 26) for t in ids)

    engine.tokenizer = CharTokenizer()
    text = CharTokenizer().decode(free)
    stop = text[2:4]                            # straddles two tokens
    engine.add_request("str", prompt(7, 4), SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, stop=[stop]))
    deltas = drain(engine)["str"]
    got = [t for d in deltas for t in d.new_token_ids]
    assert deltas[-1].finish_reason == "stop" and got == free[: text.index(stop) + len(stop)]


def test_request_waits_for_its_adapter_and_pins_it(tiny_models, steps):
    model, folder = tiny_models["llama"]
    peft_model = add_peft_adapters(copy.deepcopy(model), {"x": dict(r=4, target_modules=["q_proj", "down_proj"])})
    engine = LLMEngine(EngineConfig(model=str(folder), block_size=4, max_loras=2,
                                    async_scheduling=steps == "overlapped"))
    slots = engine.slots
    # An asynchronous load in flight: staged and queued, not copied into the pool until the test pumps it.
    slots.add_staged("x", slots.stage_adapter("x", peft_adapter_to_converted(peft_model, "x")))
    slots.prefetch("x")
    engine.add_request("cold", prompt(5, 5), GREEDY, adapter_key="x")
    engine.add_request("base", prompt(5, 6), GREEDY)
    for _ in range(3):
        engine.step()
    stats = engine.stats()
    assert stats.waiting_per_adapter == {"x": 1} and stats.running_per_adapter == {"": 1}
    assert slots.pin_count("x") == 0
    slots.pump()
    slots.wait_loads()
    engine.step()
    assert engine.stats().running_per_adapter == {"": 1, "x": 1} and slots.pin_count("x") == 1
    assert not slots.evict("x")                 # pinned adapters stay
    drain(engine)
    assert slots.pin_count("x") == 0 and slots.evict("x")


def test_preemption_gives_the_same_seeded_tokens(tiny_models, steps):
    model, folder = tiny_models["qwen2"]
    peft_model = add_peft_adapters(copy.deepcopy(model), {"x": dict(r=8, target_modules=["v_proj", "up_proj"])})
    adapter = peft_adapter_to_converted(peft_model, "x")
    # Recompute changes logits by ~1e-6 (other batch shapes), so no top-p cut-off whose edge could flip a draw.
    results = []
    for kv_bytes in (1 << 22, 2048 * 20):       # roomy, then 20 blocks of 4 tokens for 4 sequences of ~40
        engine = LLMEngine(EngineConfig(model=str(folder), block_size=4, max_model_len=64, kv_cache_bytes=kv_bytes,
                                        async_scheduling=steps == "overlapped",
                                        max_num_batched_tokens=24))
        engine.add_adapter("x", adapter)
        for i in range(4):
            engine.add_request(f"r{i}", prompt(8 + 3 * i, 10 + i),
                               SamplingParams(max_tokens=24, temperature=1.0, seed=100 + i, ignore_eos=True),
                               adapter_key="x" if i % 2 else None)
        out = drain(engine)
        results.append(({r: [t for d in ds for t in d.new_token_ids] for r, ds in out.items()},
                         engine.stats().num_preemptions))
    (roomy, n_roomy), (tight, n_tight) = results
    assert n_roomy == 0 and n_tight > 0
    assert tight == roomy and all(len(t) == 24 for t in tight.values())


def test_seeded_request_ignores_batch_mates(engine):
    p = SamplingParams(max_tokens=12, temperature=0.8, seed=42, ignore_eos=True)
    engine.add_request("alone", prompt(9, 7), p)
    alone = [t for d in drain(engine)["alone"] for t in d.new_token_ids]
    engine.add_request("noise1", prompt(15, 8), SamplingParams(max_tokens=12, temperature=1.0))
    engine.add_request("mate", prompt(9, 7), p)
    engine.add_request("noise2", prompt(4, 9), SamplingParams(max_tokens=5, temperature=1.0, seed=1))
    mate = [t for d in drain(engine)["mate"] for t in d.new_token_ids]
    assert mate == alone and len(set(alone)) > 1
