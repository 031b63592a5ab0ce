"""The gateway's resolution cache: the host cache's answers reused for `ttl_s`, shared while asked, dropped
when this gateway loads or unloads an adapter, and asked again when compute no longer finds a version."""
import asyncio

import grpc
import pytest

from loraplex.client import Lora
from loraplex.errors import NotFoundError, UnavailableError
from loraplex.formats import adapter_from_tensors
from loraplex.v1 import common_pb2, compute_pb2_grpc
from gateway.adapters import AdapterResolver
from gateway_fakes import SCRIPTS, MemoryStore, ScriptedCompute, grpc_server
from gateway_harness import gateway_stack, random_adapter, smollm2_spec

AUTO, ALWAYS, NEVER = common_pb2.LOAD_MODE_AUTO, common_pb2.LOAD_MODE_ALWAYS, common_pb2.LOAD_MODE_NEVER


def run(coro):
    return asyncio.run(coro)


class FakeClock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class CountingStore(MemoryStore):
    """MemoryStore that counts ResolveName and HasAdapter calls; with `gate` set, each call waits for it."""

    def __init__(self) -> None:
        super().__init__(smollm2_spec())
        self.resolves = 0
        self.lookups = 0
        self.gate: asyncio.Event | None = None

    async def _wait(self) -> None:
        if self.gate is not None:
            await self.gate.wait()

    async def resolve_name(self, name, load_mode):
        self.resolves += 1
        await self._wait()
        return await super().resolve_name(name, load_mode)

    async def cached_version(self, task_id):
        self.lookups += 1
        await self._wait()
        return await super().cached_version(task_id)


def adapter(seed: int):
    return adapter_from_tensors(*random_adapter(seed=seed))


def setup(ttl_s: float = 1.0):
    """A store with "jp" (task id 2) under its root and task id 1 cached; a resolver over it; its clock."""
    store, clock = CountingStore(), FakeClock()
    store.root["jp"] = (2, adapter(1))
    store.adapters[1] = adapter(2)
    return store, AdapterResolver(store, smollm2_spec(), ttl_s=ttl_s, clock=clock), clock


def named(name: str = "jp", mode: int = AUTO) -> common_pb2.LoraSpec:
    return common_pb2.LoraSpec(name=name, load_mode=mode)


def task(task_id: int = 1) -> common_pb2.LoraSpec:
    spec = common_pb2.LoraSpec()
    spec.task_id = task_id
    return spec


def test_a_name_is_asked_once_within_the_ttl_and_again_after_it():
    async def go():
        store, resolver, clock = setup()
        first = await resolver.resolve(named())
        clock.now += 0.99
        second = await resolver.resolve(named("jp", NEVER))
        calls_within = store.resolves
        clock.now += 0.01
        third = await resolver.resolve(named())
        return first, second, third, calls_within, store.resolves
    first, second, third, calls_within, calls_after = run(go())
    assert first == second == third and first.task_id == 2 and first.name == "jp"
    assert (calls_within, calls_after) == (1, 2)


def test_a_task_id_alone_is_asked_once_within_the_ttl_and_again_after_it():
    async def go():
        store, resolver, clock = setup()
        versions = [(await resolver.resolve(task(1))).version for _ in range(3)]
        calls_within = store.lookups
        clock.now += 1.0
        versions.append((await resolver.resolve(task(1))).version)
        return versions, calls_within, store.lookups, store.adapters[1].content_hash
    versions, calls_within, calls_after, version = run(go())
    assert versions == [version] * 4
    assert (calls_within, calls_after) == (1, 2)


def test_always_asks_every_time_and_its_answer_serves_auto():
    async def go():
        store, resolver, _ = setup()
        for _ in range(3):
            await resolver.resolve(named("jp", ALWAYS))
        always_calls, puts = store.resolves, store.puts
        await resolver.resolve(named("jp", AUTO))
        return always_calls, puts, store.resolves
    always_calls, puts, total = run(go())
    assert always_calls == 3 and puts == 3       # each ALWAYS reloaded from the adapter root
    assert total == 3


def test_a_ttl_of_zero_asks_every_time():
    async def go():
        store, resolver, _ = setup(ttl_s=0.0)
        for _ in range(3):
            await resolver.resolve(named())
            await resolver.resolve(task(1))
        return store.resolves, store.lookups
    assert run(go()) == (3, 3)


def test_a_negative_ttl_is_refused():
    with pytest.raises(ValueError, match="ttl_s"):
        AdapterResolver(CountingStore(), smollm2_spec(), ttl_s=-1.0)


def test_forget_drops_the_name_and_the_task_id_at_once():
    async def go():
        store, resolver, _ = setup()
        await resolver.resolve(named())
        await resolver.resolve(task(1))
        resolver.forget(None, "jp")
        await resolver.resolve(named())
        await resolver.resolve(task(1))
        after_name = (store.resolves, store.lookups)
        resolver.forget(1)
        await resolver.resolve(task(1))
        resolver.forget(2)          # by task id: the names that resolved to it go too
        await resolver.resolve(named())
        return after_name, (store.resolves, store.lookups)
    after_name, after_ids = run(go())
    assert after_name == (2, 1)
    assert after_ids == (3, 2)


def test_concurrent_resolves_of_a_stale_name_share_one_call():
    async def go():
        store, resolver, clock = setup()
        store.gate = asyncio.Event()
        results = []
        for _ in range(2):                  # a name never asked for, then the same name gone stale
            tasks = [asyncio.create_task(resolver.resolve(named())) for _ in range(50)]
            await asyncio.sleep(0.01)
            tasks[0].cancel()               # a caller that goes away leaves the call to the others
            store.gate.set()
            done = await asyncio.gather(*tasks, return_exceptions=True)
            results.append((store.resolves, done))
            store.gate.clear()
            clock.now += 5.0
        return results
    (first_calls, first), (second_calls, second) = run(go())
    assert (first_calls, second_calls) == (1, 2)
    for done in (first, second):
        assert isinstance(done[0], asyncio.CancelledError)
        assert len({(r.task_id, r.version) for r in done[1:]}) == 1


def test_concurrent_lookups_of_a_task_id_share_one_call():
    async def go():
        store, resolver, _ = setup()
        store.gate = asyncio.Event()
        tasks = [asyncio.create_task(resolver.resolve(task(1))) for _ in range(50)]
        await asyncio.sleep(0.01)
        store.gate.set()
        done = await asyncio.gather(*tasks)
        return store.lookups, {r.version for r in done}
    lookups, versions = run(go())
    assert lookups == 1 and len(versions) == 1


def test_an_answer_in_flight_when_forget_runs_is_not_kept():
    async def go():
        store, resolver, _ = setup()
        store.gate = asyncio.Event()
        pending = asyncio.create_task(resolver.resolve(named()))
        await asyncio.sleep(0.01)
        resolver.forget(2, "jp")            # e.g. an unload through this gateway while the cache answers
        store.gate.set()
        await pending
        await resolver.resolve(named())
        return store.resolves
    assert run(go()) == 2


def test_the_last_known_version_serves_while_the_cache_is_down():
    async def go():
        store, resolver, clock = setup()
        known_name = await resolver.resolve(named())
        known_task = await resolver.resolve(task(1))
        clock.now += 10.0                   # stale: the cache is asked, and is down
        store.down = True
        served = (await resolver.resolve(named()), await resolver.resolve(task(1)))
        calls = (store.resolves, store.lookups)
        errors = []
        for spec in (named("jp", ALWAYS), named("other"), task(9)):
            with pytest.raises(UnavailableError) as e:
                await resolver.resolve(spec)
            errors.append(str(e.value))
        return (known_name, known_task), served, calls, errors
    known, served, calls, errors = run(go())
    assert served == known
    assert calls == (2, 2)                  # the stale answers were asked for again, not served unasked
    assert all("host cache" in e for e in errors)


def test_an_inline_adapter_stored_updates_its_task_id_at_once():
    async def go():
        store, resolver, _ = setup()
        w1, c1 = random_adapter(seed=3)
        w2, c2 = random_adapter(rank=4, seed=4)
        first = await resolver.resolve(Lora(task_id=3, weights=w1, config=c1).to_proto())
        again = await resolver.resolve(task(3))
        replaced = await resolver.resolve(Lora(task_id=3, weights=w2, config=c2, load_mode="always").to_proto())
        after = await resolver.resolve(task(3))
        return first, again, replaced, after, store.lookups, store.adapters[3].content_hash
    first, again, replaced, after, lookups, stored = run(go())
    assert first == again and replaced == after and after.version == stored != first.version
    assert lookups == 1                     # only the first use asked whether it was cached


# --- through a gateway ---------------------------------------------------------------------------------


class HostCacheCompute(ScriptedCompute):
    """Scripted compute that fetches adapters as the real one does: a version the store no longer holds is
    NOT_FOUND (before the first token, or after it with `refuse_after_tokens`)."""

    def __init__(self, tokenizer) -> None:
        super().__init__(tokenizer)
        self.store: MemoryStore | None = None
        self.refuse_after_tokens = False

    def _missing(self, request) -> str:
        if not request.HasField("adapter") or self.store is None:
            return ""
        task_id, version = request.adapter.task_id, request.adapter.version
        held = self.store.adapters.get(task_id)
        if held is not None and held.content_hash == version:
            return ""
        return f"task id {task_id} is not in the host cache at version {version}"

    async def GenerateTokens(self, request, context):
        missing = self._missing(request)
        if missing and not self.refuse_after_tokens:
            self.log.requests.append(request)
            await context.abort(grpc.StatusCode.NOT_FOUND, missing)
        sent = 0
        async for msg in super().GenerateTokens(request, context):
            yield msg
            sent += 1
            if missing and sent == 1:
                await context.abort(grpc.StatusCode.NOT_FOUND, missing)


async def _stack_with(tokenizer, body):
    compute = HostCacheCompute(tokenizer)
    async with grpc_server(lambda s: compute_pb2_grpc.add_ComputeServicer_to_server(compute, s)) as address:
        async with gateway_stack(tokenizer, compute_address=address) as st:
            compute.store = st.store
            st.store.root["jp"] = (2, adapter(1))
            return await body(st, compute)


def _versions(compute):
    return [r.adapter.version for r in compute.log.requests]


def test_a_version_compute_no_longer_finds_is_resolved_again_and_retried_once(tokenizer):
    async def body(st, compute):
        await st.client.generate("q", lora="jp", max_tokens=3)
        v1 = st.store.adapters[2].content_hash
        st.store.adapters[2] = adapter(5)   # replaced through another gateway: this one still holds v1
        out = await st.client.generate("q", lora="jp", max_tokens=3)
        return out, v1, st.store.adapters[2].content_hash, _versions(compute)
    out, v1, v2, versions = run(_stack_with(tokenizer, body))
    assert out.task_id == 2 and out.text == tokenizer.decode(
        tokenizer.encode(SCRIPTS[2], add_special_tokens=False)[:3])
    assert versions == [v1, v1, v2]


def test_an_evicted_task_id_is_not_found_with_the_cache_message(tokenizer):
    async def body(st, compute):
        st.store.adapters[1] = adapter(6)
        await st.client.generate("q", lora=1, max_tokens=2)
        del st.store.adapters[1]            # evicted from the host cache; this gateway still holds its version
        with pytest.raises(NotFoundError) as e:
            await st.client.generate("q", lora=1, max_tokens=2)
        return str(e.value), len(compute.log.requests)
    message, num_requests = run(_stack_with(tokenizer, body))
    assert "task id 1 is not cached" in message and "weights" in message
    assert num_requests == 2                # resolved again before a second start: nothing to retry


def test_not_found_is_retried_only_once(tokenizer):
    async def body(st, compute):
        await st.client.generate("q", lora="jp", max_tokens=2)
        compute.store = MemoryStore(smollm2_spec())     # compute finds no version at all
        with pytest.raises(NotFoundError) as e:
            await st.client.generate("q", lora="jp", max_tokens=2)
        return str(e.value), len(compute.log.requests)
    message, num_requests = run(_stack_with(tokenizer, body))
    assert "not in the host cache" in message
    assert num_requests == 3                # the first request, the stale start, its one retry


def test_not_found_after_tokens_were_sent_is_not_retried(tokenizer):
    async def body(st, compute):
        await st.client.generate("q", lora="jp", max_tokens=2)
        st.store.adapters[2] = adapter(7)
        compute.refuse_after_tokens = True
        chunks = []
        with pytest.raises(NotFoundError):
            async for chunk in st.client.stream("q", lora="jp", max_tokens=20):
                chunks.append(chunk)
        return chunks, len(compute.log.requests)
    chunks, num_requests = run(_stack_with(tokenizer, body))
    assert len(chunks) == 1 and chunks[0].token_ids
    assert num_requests == 2


def test_load_and_unload_through_this_gateway_take_effect_at_once(tokenizer):
    async def body(st, compute):
        await st.client.generate("q", lora="jp", max_tokens=2)
        st.store.root["jp"] = (2, adapter(8))
        info = await st.client.load_lora(name="jp", replace=True)
        await st.client.generate("q", lora="jp", max_tokens=2)
        await st.client.unload_lora(name="jp")
        with pytest.raises(NotFoundError):
            await st.client.generate("q", lora=Lora(name="jp", load_mode="never"), max_tokens=2)
        return info.version, _versions(compute)
    loaded, versions = run(_stack_with(tokenizer, body))
    assert versions[-1] == loaded and versions[0] != loaded and len(versions) == 2


# --- a stale answer: the request starts at the last known version while the cache confirms it ----------


def _gate_resolves(store, gate: asyncio.Event) -> list[str]:
    """Makes the store's ResolveName wait for `gate`; returns the names asked, in order."""
    asked, resolve = [], store.resolve_name

    async def gated(name, load_mode):
        asked.append(name)
        await gate.wait()
        return await resolve(name, load_mode)
    store.resolve_name = gated
    return asked


async def _stale_stack_with(tokenizer, body):
    compute = HostCacheCompute(tokenizer)
    async with grpc_server(lambda s: compute_pb2_grpc.add_ComputeServicer_to_server(compute, s)) as address:
        async with gateway_stack(tokenizer, compute_address=address, adapter_resolve_ttl_s=0.0) as st:
            compute.store = st.store
            st.store.root["jp"] = (2, adapter(1))
            await st.client.generate("q", lora="jp", max_tokens=2)     # known, and stale from now on
            return await body(st, compute)


def test_a_stale_name_starts_on_compute_before_the_cache_answers_and_its_tokens_wait_for_it(tokenizer):
    async def body(st, compute):
        gate = asyncio.Event()
        asked = _gate_resolves(st.store, gate)
        chunks = []

        async def read():
            async for chunk in st.client.stream("q", lora="jp", max_tokens=3):
                chunks.append(chunk)
        reader = asyncio.create_task(read())
        for _ in range(200):
            if len(compute.log.requests) == 2 and asked:
                break
            await asyncio.sleep(0.01)
        started_early = len(compute.log.requests) == 2
        await asyncio.sleep(0.1)
        before_answer = list(chunks)
        gate.set()
        await reader
        return started_early, asked, before_answer, chunks, _versions(compute), compute.log.cancelled
    started_early, asked, before, chunks, versions, cancelled = run(_stale_stack_with(tokenizer, body))
    assert started_early and asked == ["jp"]
    assert before == []                       # nothing leaves before the host cache confirmed the version
    assert "".join(c.text for c in chunks) == tokenizer.decode(
        tokenizer.encode(SCRIPTS[2], add_special_tokens=False)[:3])
    assert versions[0] == versions[1] and not cancelled


def test_a_stale_version_the_cache_contradicts_is_cancelled_and_started_again(tokenizer):
    async def body(st, compute):
        v1 = st.store.adapters[2].content_hash
        st.store.adapters[2] = adapter(9)            # replaced through another gateway
        compute.store = None                         # compute still serves the old version too
        compute.delay_s = 0.2                        # still running when the cache answers
        out = await st.client.generate("q", lora="jp", max_tokens=3)
        return out, v1, st.store.adapters[2].content_hash, _versions(compute), compute.log.cancelled
    out, v1, v2, versions, cancelled = run(_stale_stack_with(tokenizer, body))
    assert v1 != v2 and versions == [v1, v1, v2]
    assert len(cancelled) == 1                       # the request started at v1 was stopped on compute
    assert out.text == tokenizer.decode(tokenizer.encode(SCRIPTS[2], add_special_tokens=False)[:3])


def test_a_stale_name_that_is_gone_fails_and_its_started_request_is_cancelled(tokenizer):
    async def body(st, compute):
        del st.store.root["jp"]
        st.store.names.pop("jp", None)
        del st.store.adapters[2]
        compute.store = None
        compute.delay_s = 0.2
        with pytest.raises(NotFoundError):
            await st.client.generate("q", lora="jp", max_tokens=50)
        for _ in range(100):
            if compute.log.cancelled:
                break
            await asyncio.sleep(0.01)
        return len(compute.log.requests), compute.log.cancelled
    num_requests, cancelled = run(_stale_stack_with(tokenizer, body))
    assert num_requests == 2 and len(cancelled) == 1
