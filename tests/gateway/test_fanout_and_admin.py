"""Fan-out, adapter management and the message-size limit through a real gateway server."""
import asyncio

import grpc
import pytest

from loraplex.client import Lora
from loraplex.errors import InvalidArgumentError, NotFoundError, ResourceExhaustedError
from gateway_fakes import FAIL_TASK_ID, SCRIPTS
from gateway_harness import gateway_stack, random_adapter


def run(coro):
    return asyncio.run(coro)


def text_of(tokenizer, task_id, n):
    ids = tokenizer.encode(SCRIPTS[task_id], add_special_tokens=False)[:n]
    return tokenizer.decode(ids, skip_special_tokens=True)


def test_fan_out_base_and_two_adapters_each_equal_to_alone(tokenizer):
    async def go():
        async with gateway_stack(tokenizer, delay_s=0.005) as st:
            for task_id in (1, 2):
                w, c = random_adapter()
                await st.client.generate("x", lora=Lora(task_id=task_id, weights=w, config=c), max_tokens=1)
            chunks = [ch async for ch in st.client.stream("q", [None, 1, 2], max_tokens=12)]
            alone = [await st.client.generate("q", lora=t, max_tokens=12) for t in (None, 1, 2)]
            return chunks, alone, st.compute.log
    chunks, alone, log = run(go())
    indices = [c.index for c in chunks]
    assert set(indices) == {0, 1, 2}
    assert indices != sorted(indices), "entries should interleave, not run one after another"
    for i, task_id in enumerate((None, 1, 2)):
        mine = [c for c in chunks if c.index == i]
        assert "".join(c.text for c in mine) == alone[i].text == text_of(tokenizer, task_id, 12)
        assert all(c.task_id == task_id for c in mine)
        assert [c.finish_reason for c in mine].count("length") == 1 and mine[-1].finish_reason == "length"
    fan_ids = [r.request_id for r in log.requests[2:5]]
    assert len(set(fan_ids)) == 3 and all("/" in r for r in fan_ids)


def test_one_failing_entry_ends_only_its_own_stream(tokenizer):
    async def go():
        async with gateway_stack(tokenizer) as st:
            w, c = random_adapter()
            await st.client.generate("x", lora=Lora(task_id=1, weights=w, config=c), max_tokens=1)
            w, c = random_adapter()
            bad = Lora(task_id=FAIL_TASK_ID, weights=w, config=c)
            return await st.client.fan_out("q", [1, bad, 99, None], max_tokens=10)
    outs = run(go())
    assert [o.finish_reason for o in outs] == ["length", "error", "error", "length"]
    assert outs[0].text == text_of(tokenizer, 1, 10) and outs[3].text == text_of(tokenizer, None, 10)
    assert "engine step failed" in outs[1].error and outs[1].task_id == FAIL_TASK_ID
    assert outs[2].error.startswith("NOT_FOUND") and "task id 99" in outs[2].error and outs[2].task_id == 99


def test_load_list_unload_and_model_info(tokenizer):
    async def go():
        async with gateway_stack(tokenizer) as st:
            w, c = random_adapter(rank=4)
            info = await st.client.load_lora(task_id=5, name="five", weights=w, config=c)
            listing = await st.client.list_loras()
            with pytest.raises(Exception) as dup:
                await st.client.load_lora(task_id=5, weights=w, config=c)
            out = await st.client.generate("q", lora="five", max_tokens=3)
            unloaded = await st.client.unload_lora(name="five")
            with pytest.raises(NotFoundError):
                await st.client.generate("q", lora=5)
            again = await st.client.unload_lora(task_id=5)
            with pytest.raises(InvalidArgumentError):
                await st.client.unload_lora()
            model = await st.client.model_info()
            return info, listing, dup.value, out, unloaded, again, model, st
    info, listing, dup, out, unloaded, again, model, st = run(go())
    assert info.task_id == 5 and info.name == "five" and info.max_rank == 4 and info.num_bytes == w_bytes(info)
    assert [a.task_id for a in listing.adapters] == [5] and listing.host_cache_bytes_used == info.num_bytes
    assert dup.grpc_code == grpc.StatusCode.ALREADY_EXISTS
    assert out.task_id == 5
    assert unloaded is True and again is False
    assert st.compute.log.dropped == [5, 5]  # compute drops it once running requests finish
    assert model.model_name == "scripted" and model.max_model_len == 256


def w_bytes(info):
    return info.num_bytes  # the store reports the converted size; checked against the listing above


def test_gpu_residency_comes_from_compute_stats(tokenizer):
    async def go():
        async with gateway_stack(tokenizer) as st:
            for t in (1, 2):
                w, c = random_adapter()
                await st.client.load_lora(task_id=t, weights=w, config=c)
            return await st.client.list_loras()
    listing = run(go())
    assert {a.task_id: a.in_gpu_cache for a in listing.adapters} == {1: True, 2: False}


def test_request_over_the_message_limit_is_resource_exhausted_naming_it(tokenizer):
    async def go():
        async with gateway_stack(tokenizer, max_message_bytes=4 << 20) as st:
            w, c = random_adapter(rank=64, layers=range(6), modules=(1, 5, 6, 7))  # ~6.5 MB of fp16
            with pytest.raises(ResourceExhaustedError) as e:
                await st.client.generate("q", lora=Lora(task_id=1, weights=w, config=c))
            return e.value, st
    err, st = run(go())
    assert f"limit of {4 << 20} bytes" in str(err) and "--max-message-bytes" in str(err)
    assert st.store.puts == 0


def test_load_by_name_alone_and_compute_failure_of_a_single_entry(tokenizer):
    from loraplex.formats import adapter_from_tensors

    async def go():
        async with gateway_stack(tokenizer) as st:
            st.store.root["jp"] = (2, adapter_from_tensors(*random_adapter()))
            info = await st.client.load_lora(name="jp")
            w, c = random_adapter()
            with pytest.raises(Exception) as e:
                await st.client.generate("q", lora=Lora(task_id=FAIL_TASK_ID, weights=w, config=c), max_tokens=10)
            return info, e.value
    info, err = run(go())
    assert info.task_id == 2 and info.name == "jp"
    assert err.grpc_code == grpc.StatusCode.INTERNAL and "engine step failed" in str(err)
