"""Generate through a real gateway server over a scripted compute server."""
import asyncio
import logging

import grpc
import pytest

from loraplex.client import Client, Lora
from loraplex.detokenize import REPLACEMENT_CHAR
from loraplex.errors import InvalidArgumentError, NotFoundError, UnavailableError
from gateway_fakes import SCRIPTS
from gateway_harness import gateway_stack, random_adapter


def run(coro):
    return asyncio.run(coro)


def expected(tokenizer, task_id, max_tokens):
    ids = tokenizer.encode(SCRIPTS[task_id], add_special_tokens=False)[:max_tokens]
    return ids, tokenizer.decode(ids, skip_special_tokens=True)


def test_base_model_stream_text_tokens_and_usage(tokenizer):
    async def go():
        async with gateway_stack(tokenizer) as st:
            chunks = [c async for c in st.client.stream("Where is Tokyo?", max_tokens=200)]
            return chunks, st.compute.log
    chunks, log = run(go())
    ids, text = expected(tokenizer, None, 200)
    assert [t for c in chunks for t in c.token_ids] == ids + [tokenizer.eos_token_id]
    assert "".join(c.text for c in chunks) == text
    assert all(REPLACEMENT_CHAR not in c.text for c in chunks)
    assert [c.finish_reason for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    last = chunks[-1]
    assert last.finish_reason == "stop" and last.task_id is None
    prompt_ids = tokenizer.encode("Where is Tokyo?")
    assert (last.prompt_tokens, last.completion_tokens) == (len(prompt_ids), len(ids) + 1)
    assert list(log.requests[0].input_ids) == prompt_ids
    assert not log.requests[0].HasField("adapter")


@pytest.mark.parametrize("log_requests", [False, True])
def test_the_per_request_line_is_info_only_with_log_requests(tokenizer, caplog, log_requests):
    caplog.set_level(logging.DEBUG, logger="gateway.servicer")

    async def go():
        async with gateway_stack(tokenizer, log_requests=log_requests) as st:
            await st.client.generate("hi", max_tokens=2, request_id="req-77")
    run(go())
    lines = [r for r in caplog.records if r.name == "gateway.servicer" and "generate req-77" in r.getMessage()]
    assert [r.levelno for r in lines] == [logging.INFO if log_requests else logging.DEBUG]
    assert "max_tokens 2" in lines[0].getMessage()


def test_max_tokens_gives_length_and_default_applies(tokenizer):
    async def go():
        async with gateway_stack(tokenizer, default_max_tokens=5) as st:
            a = await st.client.generate("hi", max_tokens=7)
            b = await st.client.generate("hi")
            return a, b, st.compute.log
    a, b, log = run(go())
    assert a.finish_reason == "length" and a.completion_tokens == 7 and len(a.token_ids) == 7
    assert a.text == expected(tokenizer, None, 7)[1]
    assert b.completion_tokens == 5 and log.requests[1].sampling.max_tokens == 5


def test_chat_applies_the_template(tokenizer):
    async def go():
        async with gateway_stack(tokenizer) as st:
            await st.client.generate("What is 2+2?", chat=True, max_tokens=2)
            return st.compute.log
    log = run(go())
    templated = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2+2?"}],
                                              tokenize=False, add_generation_prompt=True)
    assert list(log.requests[0].input_ids) == tokenizer.encode(templated, add_special_tokens=False)


def test_stop_string_cuts_output_and_cancels_compute(tokenizer):
    async def go():
        async with gateway_stack(tokenizer, delay_s=0.01) as st:
            w, c = random_adapter()
            out = await st.client.generate("q", lora=Lora(task_id=2, weights=w, config=c), max_tokens=100,
                                           stop=["\nUser:"])
            await asyncio.sleep(0.2)
            return out, st.compute.log
    out, log = run(go())
    assert out.finish_reason == "stop"
    assert out.text == SCRIPTS[2].split("\nUser:")[0]
    assert log.cancelled == [log.requests[0].request_id]
    assert list(log.requests[0].sampling.stop) == []  # compute never sees stop strings


def test_inline_adapter_cached_on_first_use_then_task_id_alone(tokenizer):
    async def go():
        async with gateway_stack(tokenizer) as st:
            w, c = random_adapter()
            first = await st.client.generate("q", lora=Lora(task_id=1, weights=w, config=c), max_tokens=50)
            again = await st.client.generate("q", lora=1, max_tokens=50)
            resent = await st.client.generate("q", lora=Lora(task_id=1, weights=w, config=c), max_tokens=50)
            return first, again, resent, st
    first, again, resent, st = run(go())
    assert first.text == again.text == resent.text == expected(tokenizer, 1, 50)[1]
    assert first.task_id == 1
    assert st.store.puts == 1  # AUTO: the cached copy is used once it exists
    version = st.store.adapters[1].content_hash
    assert [(r.adapter.task_id, r.adapter.version) for r in st.compute.log.requests] == [(1, version)] * 3


def test_unknown_task_id_and_never_mode_are_not_found(tokenizer):
    async def go():
        async with gateway_stack(tokenizer) as st:
            with pytest.raises(NotFoundError) as e1:
                await st.client.generate("q", lora=7)
            w, c = random_adapter()
            with pytest.raises(NotFoundError):
                await st.client.generate("q", lora=Lora(task_id=8, weights=w, config=c, load_mode="never"))
            with pytest.raises(NotFoundError):
                await st.client.generate("q", lora="no_such_adapter")
            return e1.value, st
    err, st = run(go())
    assert err.grpc_code == grpc.StatusCode.NOT_FOUND
    assert "task id 7 is not cached" in str(err) and "weights" in str(err)
    assert st.store.adapters == {} and st.compute.log.requests == []


def test_always_replaces_the_cached_adapter(tokenizer):
    async def go():
        async with gateway_stack(tokenizer) as st:
            w1, c1 = random_adapter()
            w2, c2 = random_adapter(rank=4)
            await st.client.generate("q", lora=Lora(task_id=3, weights=w1, config=c1), max_tokens=2)
            v1 = st.store.adapters[3].content_hash
            await st.client.generate("q", lora=Lora(task_id=3, weights=w2, config=c2, load_mode="always"),
                                     max_tokens=2)
            return v1, st
    v1, st = run(go())
    v2 = st.store.adapters[3].content_hash
    assert v1 != v2 and st.store.puts == 2
    assert st.compute.log.requests[-1].adapter.version == v2


def test_invalid_inline_tensors_are_refused_before_caching(tokenizer):
    async def go():
        async with gateway_stack(tokenizer) as st:
            w, c = random_adapter()
            w[1, 5] = float("nan")
            with pytest.raises(InvalidArgumentError) as e1:
                await st.client.generate("q", lora=Lora(task_id=4, weights=w, config=c))
            w, c = random_adapter()
            c[0, 1] = 99  # layer out of range
            with pytest.raises(InvalidArgumentError) as e2:
                await st.client.generate("q", lora=Lora(task_id=4, weights=w, config=c))
            with pytest.raises(InvalidArgumentError) as e3:
                await st.client.generate("q", lora=Lora(weights=w, config=c))
            return e1.value, e2.value, e3.value, st
    e1, e2, e3, st = run(go())
    assert "row 1" in str(e1) and "nan" in str(e1).lower()
    assert "row 0" in str(e2) and "layer 99" in str(e2)
    assert "task_id" in str(e3)
    assert st.store.puts == 0 and st.compute.log.requests == []


def test_a_huge_adapter_name_is_refused_with_a_bounded_message(tokenizer):
    """A 20,000-character name is echoed in the refusal; cut, it stays a status the client can read."""
    async def go():
        async with gateway_stack(tokenizer) as st:
            with pytest.raises(NotFoundError) as e:
                await st.client.generate("q", lora="n" * 20_000)
            return e.value
    err = run(go())
    assert err.grpc_code == grpc.StatusCode.NOT_FOUND
    assert len(str(err)) <= 1024 + len("NOT_FOUND: ") and "characters cut" in str(err)


def test_named_adapter_resolves_through_the_store(tokenizer):
    async def go():
        async with gateway_stack(tokenizer) as st:
            from loraplex.formats import adapter_from_tensors
            w, c = random_adapter()
            st.store.root["jp"] = (2, adapter_from_tensors(w, c))
            out = await st.client.generate("q", lora="jp", max_tokens=4)
            return out, st
    out, st = run(go())
    assert out.task_id == 2 and out.text == expected(tokenizer, 2, 4)[1]
    assert st.store.names == {"jp": 2}


def test_bad_requests_are_invalid_argument(tokenizer):
    async def go():
        async with gateway_stack(tokenizer, max_model_len=8) as st:
            errs = []
            for prompt, kw in [("q", {"temperature": -1.0}), ("q", {"top_p": 1.5}), ("q", {"stop": [""]}),
                               ("", {}), ([10**9], {}), ("word " * 20, {}), ([1, 2], {"chat": True})]:
                with pytest.raises(InvalidArgumentError) as e:
                    await st.client.generate(prompt, **kw)
                errs.append(str(e.value))
            return errs, st.compute.log
    errs, log = run(go())
    assert "temperature" in errs[0] and "top_p" in errs[1] and "stop" in errs[2]
    assert "empty" in errs[3] and "vocabulary" in errs[4] and "max_model_len 8" in errs[5]
    assert "chat" in errs[6]
    assert log.requests == []


def test_compute_down_is_unavailable_naming_it(tokenizer, free_port):
    async def go():
        async with gateway_stack(tokenizer, compute_address=f"127.0.0.1:{free_port}") as st:
            with pytest.raises(UnavailableError) as e:
                await st.client.generate("q")
            return e.value
    err = run(go())
    assert f"127.0.0.1:{free_port}" in str(err) and "compute" in str(err)


def test_client_cancel_and_deadline_reach_compute(tokenizer):
    async def go():
        async with gateway_stack(tokenizer, delay_s=0.05) as st:
            stream = st.client.stream("q", max_tokens=100)
            async for _ in stream:
                break
            await stream.aclose()
            for _ in range(50):
                if st.compute.log.cancelled:
                    break
                await asyncio.sleep(0.05)
            from loraplex.client import AsyncClient
            async with AsyncClient(st.address, timeout=0.3) as short:
                with pytest.raises(Exception) as e:
                    await short.generate("q", max_tokens=100)
            await asyncio.sleep(0.3)
            return st.compute.log, e.value
    log, err = run(go())
    assert log.cancelled[0] == log.requests[0].request_id
    assert err.grpc_code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert log.deadlines[1] is not None and log.deadlines[1] < 0.5  # the caller's deadline went on
    assert log.requests[1].request_id in log.cancelled


def test_sync_client_against_the_same_server(tokenizer):
    async def go():
        async with gateway_stack(tokenizer) as st:
            def call():
                with Client(st.address, timeout=30) as c:
                    return c.generate("q", max_tokens=6), list(c.stream("q", max_tokens=3))
            return await asyncio.to_thread(call)
    out, chunks = run(go())
    assert out.text == expected(tokenizer, None, 6)[1] and out.finish_reason == "length"
    assert sum(len(c.token_ids) for c in chunks) == 3


def test_cache_down_keeps_known_adapters_serving_and_refuses_new_ones(tokenizer):
    from loraplex.errors import UnavailableError

    async def go():
        async with gateway_stack(tokenizer) as st:
            w, c = random_adapter()
            await st.client.generate("q", lora=Lora(task_id=1, weights=w, config=c), max_tokens=3)
            from loraplex.formats import adapter_from_tensors
            st.store.root["jp"] = (2, adapter_from_tensors(*random_adapter()))
            await st.client.generate("q", lora="jp", max_tokens=3)
            st.store.down = True
            known = await st.client.generate("q", lora=1, max_tokens=5)
            named = await st.client.generate("q", lora="jp", max_tokens=5)
            errs = []
            for lora in (Lora(task_id=3, weights=w, config=c), 9, Lora(name="jp", load_mode="always")):
                with pytest.raises(UnavailableError) as e:
                    await st.client.generate("q", lora=lora)
                errs.append(str(e.value))
            return known, named, errs
    known, named, errs = run(go())
    assert known.text == expected(tokenizer, 1, 5)[1] and named.text == expected(tokenizer, 2, 5)[1]
    assert all("host cache" in e for e in errs)
