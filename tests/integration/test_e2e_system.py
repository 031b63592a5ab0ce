"""End to end on the CPU with SmolLM2: cache, compute and gateway as real processes.

The seed's multi-LoRA scenario through the Python client and through the real
grpcurl binary, fan-out, named adapters, PEFT numerics against transformers,
NOT_FOUND, and (last, since it kills the cache) UNAVAILABLE for new adapters
while cached ones keep serving.
"""
from __future__ import annotations

import base64
import concurrent.futures as cf
import signal

import pytest

from loraplex.client import Client, Lora
from loraplex.errors import NotFoundError, UnavailableError
from loraplex.formats import load_adapter
from loraplex.model_files import load_tokenizer
from integration.e2e_support import (PROMPT_EN, PROMPT_JA, PROMPT_ZH, grpcurl_generate, start_stack,
                                     write_peft_adapter)

pytestmark = [pytest.mark.serial, pytest.mark.slow, pytest.mark.timeout(1200)]

STD = 0.05  # adapter factor scale: changes greedy output, keeps it text


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    base = tmp_path_factory.mktemp("adapters")
    write_peft_adapter(base / "root" / "jp", seed=3, std=STD)
    return {"root": base / "root", 1: write_peft_adapter(base / "a1", seed=1, std=STD),
            2: write_peft_adapter(base / "a2", seed=2, std=STD)}


@pytest.fixture(scope="module")
def stack(adapters):
    s = start_stack(adapters["root"])
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(stack):
    with Client(stack.address, timeout=600) as c:
        yield c


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("")


def inline(folder, task_id: int, dtype: str | None = None) -> Lora:
    a = load_adapter(folder, dtype=dtype)
    return Lora(task_id=task_id, weights=a.weights, config=a.config)


SIX = [(PROMPT_ZH, None), (PROMPT_ZH, 1), (PROMPT_ZH, 2), (PROMPT_JA, None), (PROMPT_JA, 1), (PROMPT_JA, 2)]


def test_seed_scenario_six_concurrent_requests_each_equal_to_alone(client, adapters, tokenizer):
    # First requests carry the weights (the seed's "dummy" requests), concurrently.
    with cf.ThreadPoolExecutor(2) as pool:
        firsts = list(pool.map(lambda t: client.generate("dummy", lora=inline(adapters[t], t), top_k=0, top_p=0.5,
                                                         max_tokens=10, seed=7), (1, 2)))
    assert all(f.completion_tokens > 0 for f in firsts)
    # Then six concurrent requests that send only task ids.
    with cf.ThreadPoolExecutor(6) as pool:
        batch = list(pool.map(lambda pt: client.generate(pt[0], lora=pt[1], max_tokens=10), SIX))
    alone = [client.generate(p, lora=t, max_tokens=10) for p, t in SIX]
    for got, want, (prompt, task) in zip(batch, alone, SIX):
        assert got.token_ids == want.token_ids, (prompt, task)
        assert got.text == want.text == tokenizer.decode(got.token_ids, skip_special_tokens=True)
        assert got.finish_reason in ("length", "stop") and got.task_id == task
    assert len({tuple(o.token_ids) for o in batch[:3]}) == 3, "base, task 1 and task 2 should differ"
    assert len({tuple(o.token_ids) for o in batch[3:]}) == 3


def _grpcurl_body(prompt: str, lora: Lora | None, max_tokens: int) -> dict:
    body: dict = {"text": prompt, "sampling": {"max_tokens": max_tokens}}
    if lora is not None:
        spec: dict = {"task_id": str(lora.task_id)}
        if lora.weights is not None:
            from loraplex.tensor_proto import tensor_to_proto
            for key, t in (("weights", lora.weights), ("config", lora.config)):
                msg = tensor_to_proto(t)
                spec[key] = {"dtype": msg.dtype, "shape": [str(d) for d in msg.shape],
                             "data": base64.b64encode(msg.data).decode()}
        body["loras"] = [spec]
    return body


def _collect(messages: list[dict]) -> tuple[list[int], str, str]:
    """grpcurl prints fields by their .proto names (token_ids, finish_reason, ...)."""
    ids = [int(t) for m in messages for t in m.get("token_ids", [])]
    return ids, "".join(m.get("text", "") for m in messages), messages[-1].get("finish_reason", "")


def test_seed_scenario_through_grpcurl(stack, client, adapters):
    for task in (11, 12):  # the first request of each adapter carries its tensors (fp16 to keep the JSON small)
        first = grpcurl_generate(stack.address, _grpcurl_body("dummy", inline(adapters[task - 10], task, "float16"), 4))
        assert _collect(first)[2] in ("LENGTH", "STOP")
    six = [(p, None if t is None else t + 10) for p, t in SIX]
    with cf.ThreadPoolExecutor(6) as pool:
        outs = list(pool.map(lambda pt: grpcurl_generate(
            stack.address, _grpcurl_body(pt[0], None if pt[1] is None else Lora(task_id=pt[1]), 10)), six))
    for messages, (prompt, task) in zip(outs, six):
        ids, text, finish = _collect(messages)
        alone = client.generate(prompt, lora=task, max_tokens=10)
        assert (ids, text) == (alone.token_ids, alone.text), (prompt, task)
        assert finish.lower() == alone.finish_reason
        if task is not None:
            assert all(m["task_id"] == str(task) and m["has_task_id"] for m in messages)


def test_fan_out_base_and_two_adapters(client):
    outs = client.fan_out(PROMPT_EN, [None, 1, 2], max_tokens=12)
    for i, task in enumerate((None, 1, 2)):
        alone = client.generate(PROMPT_EN, lora=task, max_tokens=12)
        assert outs[i].token_ids == alone.token_ids and outs[i].text == alone.text
        assert outs[i].task_id == task and outs[i].prompt_tokens == alone.prompt_tokens
    assert len({tuple(o.token_ids) for o in outs}) == 3


def test_named_adapter_from_the_adapter_root(client):
    out = client.generate(PROMPT_EN, lora="jp", max_tokens=8)
    base = client.generate(PROMPT_EN, max_tokens=8)
    assert out.task_id is not None and out.token_ids != base.token_ids
    listing = {a.name: a for a in client.list_loras().adapters}
    assert listing["jp"].task_id == out.task_id and listing["jp"].in_host_cache


def test_peft_greedy_equals_transformers_peft(client, adapters, tokenizer):
    import torch
    from peft import PeftModel

    from hf_reference import reference_model
    from loraplex.model_files import resolve_model_path
    model = reference_model(resolve_model_path(""))
    peft_model = PeftModel.from_pretrained(model, str(adapters[1])).eval()
    for prompt in (PROMPT_EN, PROMPT_ZH):
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            ref = peft_model.generate(ids, max_new_tokens=24, do_sample=False)[0, ids.shape[1]:].tolist()
        got = client.generate(prompt, lora=1, max_tokens=24, ignore_eos=True)
        n = len(ref)  # transformers stops at EOS; loraplex was told to go on
        assert got.token_ids[:n] == ref, prompt


def test_unknown_task_id_is_not_found(client):
    with pytest.raises(NotFoundError) as e:
        client.generate(PROMPT_EN, lora=4242)
    assert "task id 4242" in str(e.value)


def _compute_running(stack) -> int:
    import grpc

    from loraplex.v1 import compute_pb2, compute_pb2_grpc
    with grpc.insecure_channel(stack.compute.address) as ch:
        return compute_pb2_grpc.ComputeStub(ch).GetStats(compute_pb2.GetStatsRequest(), timeout=30).num_running


def _wait_idle(stack, timeout_s: float = 30.0) -> bool:
    import time
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if _compute_running(stack) == 0:
            return True
        time.sleep(0.2)
    return False


def test_cancel_and_deadline_free_the_sequence_on_compute(stack, client):
    stream = client.stream(PROMPT_EN, max_tokens=400, ignore_eos=True)
    next(stream)
    assert _compute_running(stack) == 1
    stream.close()  # the client cancels mid-stream
    assert _wait_idle(stack), "compute still runs a cancelled request"
    from loraplex.errors import LoraplexError
    with Client(stack.address, timeout=1.5) as short:
        with pytest.raises(LoraplexError) as e:
            short.generate(PROMPT_EN, max_tokens=400, ignore_eos=True)
    assert e.value.grpc_code.name == "DEADLINE_EXCEEDED"
    assert _wait_idle(stack), "compute still runs a request whose deadline passed"


def test_unload_lets_running_requests_finish_and_refuses_new_ones(stack, client, adapters):
    client.load_lora(task_id=31, local_path=adapters[2])
    stream = client.stream(PROMPT_EN, lora=31, max_tokens=40, ignore_eos=True)
    chunks = [next(stream)]
    assert client.unload_lora(task_id=31) is True
    chunks += list(stream)
    assert chunks[-1].finish_reason == "length" and sum(len(c.token_ids) for c in chunks) == 40
    with pytest.raises(NotFoundError):
        client.generate(PROMPT_EN, lora=31, max_tokens=2)
    assert 31 not in {a.task_id for a in client.list_loras().adapters}


def test_killing_the_cache_refuses_new_adapters_while_cached_ones_serve(stack, client, adapters):
    before = client.generate(PROMPT_EN, lora=1, max_tokens=6)
    stack.cache.proc.send_signal(signal.SIGKILL)
    stack.cache.proc.wait(10)
    after = client.generate(PROMPT_EN, lora=1, max_tokens=6)
    assert after.token_ids == before.token_ids
    with pytest.raises(UnavailableError) as e:
        client.generate(PROMPT_EN, lora=inline(adapters[2], 21), max_tokens=2)
    assert "host cache" in str(e.value)
    assert client.generate(PROMPT_EN, max_tokens=3).completion_tokens == 3  # the base model is unaffected
