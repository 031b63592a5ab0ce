"""The soak and fault scenarios of bench/soak.py (and tests/reliability/), each against a running `Stack`.

Every scenario drives the public gateway with real gRPC streams and returns a dict of figures and of
what went wrong (`problems`: empty when the scenario held). Outputs are greedy with the end-of-sequence
token ignored, so each (prompt, adapter) pair has one right answer: the tokens the same request gets
when it runs alone, asked for before the load starts.

- `streams`: many concurrent streams over base + adapters, some cancelled by their client after a few
  tokens, some given a short deadline; every token a stream got is a prefix of its alone answer, every
  full stream equals it, nothing ends with a status other than OK/CANCELLED/DEADLINE_EXCEEDED, and once
  the streams ended nothing is held (`Stack.leaks`).
- `stalled_reader`: a client that stops reading a long stream; streams beside it finish as fast as
  without it, and the gateway ends the stalled one (RESOURCE_EXHAUSTED) once its buffer bound is hit,
  freeing it on compute, instead of buffering the whole output.
- `kill_compute`: SIGKILL of a compute replica under streams: each of its streams ends with
  UNAVAILABLE (time from the kill measured), and new requests run on the other replica.
- `kill_cache`: SIGKILL of the cache service while adapters are loading: loads and requests that need
  the cache end with UNAVAILABLE, the base model keeps serving, and after a restart on the same address
  adapters load and serve again (time to recover measured).
- `restart_redis`: redis-server killed and restarted empty under the redis backend: UNAVAILABLE while
  down, named adapters reload from disk afterwards.
"""
from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field
from typing import Any

import grpc

from loraplex.client_types import build_generate_request
from loraplex.v1 import gateway_pb2, gateway_pb2_grpc

from soak_stack import Stack, rss_bytes

VOCAB_LOW, VOCAB_HIGH = 3, 255     # byte tokens of the tiny model (0-255), clear of the specials


@dataclass
class Plan:
    """One stream: prompt, adapter name (None: base), and how its client behaves."""

    index: int
    prompt: tuple[int, ...]
    lora: str | None
    max_tokens: int
    cancel_after: int | None = None     # the client cancels once it has this many tokens
    deadline_s: float | None = None     # the call's deadline


@dataclass
class Result:
    plan: Plan
    code: str = "OK"
    detail: str = ""
    tokens: list[int] = field(default_factory=list)
    finish: int = 0
    sent: float = 0.0
    first: float | None = None
    ended: float = 0.0


def percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p90": None, "p99": None, "max": None}
    v = sorted(values)

    def at(q: float) -> float:
        return v[min(len(v) - 1, int(q * len(v)))]
    return {"p50": at(0.5), "p90": at(0.9), "p99": at(0.99), "max": v[-1]}


def channel(address: str, window_bytes: int = 0) -> grpc.aio.Channel:
    """A client channel; `window_bytes` > 0 fixes its HTTP/2 receive window (no growth by BDP probes), so
    a client that stops reading holds at most that much in transit."""
    options = [("grpc.max_receive_message_length", 64 << 20)]
    if window_bytes:
        options += [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", window_bytes)]
    return grpc.aio.insecure_channel(address, options=options)


async def run_stream(stub: gateway_pb2_grpc.GatewayStub, plan: Plan, stop_reading: asyncio.Event | None = None
                     ) -> Result:
    """Runs one planned stream to its end (or its client's cancel); never raises for a status."""
    req = build_generate_request(list(plan.prompt), [plan.lora] if plan.lora else [], max_tokens=plan.max_tokens,
                                 ignore_eos=True, request_id=f"soak-{plan.index}-{id(plan) & 0xffff:x}")
    res = Result(plan, sent=time.monotonic())
    call = stub.Generate(req, timeout=plan.deadline_s)
    try:
        async for msg in call:
            if msg.token_ids and res.first is None:
                res.first = time.monotonic()
            res.tokens += msg.token_ids
            res.finish = msg.finish_reason or res.finish
            if plan.cancel_after is not None and len(res.tokens) >= plan.cancel_after:
                call.cancel()
                res.code = "CANCELLED"
                break
    except grpc.aio.AioRpcError as exc:
        res.code, res.detail = exc.code().name, exc.details() or ""
    res.ended = time.monotonic()
    return res


async def answers(stub: gateway_pb2_grpc.GatewayStub, pairs: set[tuple[tuple[int, ...], str | None]],
                  max_tokens: int) -> dict[tuple[tuple[int, ...], str | None], Result]:
    """Each (prompt, adapter) run alone, one after another."""
    out = {}
    for prompt, lora in sorted(pairs, key=repr):
        r = await run_stream(stub, Plan(-1, prompt, lora, max_tokens))
        if r.code != "OK":
            raise RuntimeError(f"the alone run of {prompt} on {lora} failed: {r.code} {r.detail}")
        out[(prompt, lora)] = r
    return out


def make_plans(num: int, loras: list[str | None], max_tokens: int, *, num_prompts: int, cancel_frac: float,
               deadline_frac: float, seed: int, deadline_range_s: tuple[float, float] = (0.05, 1.5)) -> list[Plan]:
    rng = random.Random(seed)
    prompts = [tuple(rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(rng.randrange(3, 24)))
               for _ in range(num_prompts)]
    plans = []
    for i in range(num):
        p = Plan(i, prompts[i % num_prompts], loras[rng.randrange(len(loras))], max_tokens)
        roll = rng.random()
        if roll < cancel_frac:
            p.cancel_after = rng.randrange(1, max_tokens)
        elif roll < cancel_frac + deadline_frac:
            p.deadline_s = rng.uniform(*deadline_range_s)
        plans.append(p)
    return plans


def expected_codes(plan: Plan) -> set[str]:
    """How a stream may end: a client's cancel, its deadline, or else OK (any other ending is a fault)."""
    if plan.cancel_after is not None:
        return {"CANCELLED"}
    if plan.deadline_s is not None:
        return {"OK", "DEADLINE_EXCEEDED"}
    return {"OK"}


def check_results(results: list[Result], alone: dict, problems: list[str]) -> None:
    for r in results:
        want = alone[(r.plan.prompt, r.plan.lora)]
        if r.code not in expected_codes(r.plan):
            problems.append(f"stream {r.plan.index} ({r.plan.lora}) ended {r.code}: {r.detail[:300]}")
        elif r.tokens != want[:len(r.tokens)]:
            problems.append(f"stream {r.plan.index} ({r.plan.lora}) got {r.tokens}, alone {want}")
        elif r.code == "OK" and r.tokens != want:
            problems.append(f"stream {r.plan.index} ({r.plan.lora}) ended OK with {len(r.tokens)} of "
                            f"{len(want)} tokens")


def summarize(results: list[Result]) -> dict[str, Any]:
    codes: dict[str, int] = {}
    for r in results:
        codes[r.code] = codes.get(r.code, 0) + 1
    return {"codes": codes,
            "tokens": sum(len(r.tokens) for r in results),
            "ttft_s": percentiles([r.first - r.sent for r in results if r.first is not None]),
            "e2e_s": percentiles([r.ended - r.sent for r in results if r.code == "OK"])}


async def _burst(address: str, num: int) -> dict[str, int]:
    async with channel(address) as ch:
        stub = gateway_pb2_grpc.GatewayStub(ch)

        async def one() -> str:
            try:
                await stub.GetModelInfo(gateway_pb2.GetModelInfoRequest(), timeout=120)
                return "OK"
            except grpc.aio.AioRpcError as exc:
                return exc.code().name
        codes: dict[str, int] = {}
        for code in await asyncio.gather(*[one() for _ in range(num)]):
            codes[code] = codes.get(code, 0) + 1
        return codes


def burst(stack: Stack, num: int) -> dict[str, int]:
    """`num` GetModelInfo calls at once: how they ended (the gateway must take them all, not drop some)."""
    return asyncio.run(_burst(stack.address, num))


async def _streams(stack: Stack, plans: list[Plan], max_tokens: int) -> dict[str, Any]:
    problems: list[str] = []
    async with channel(stack.address) as ch:
        stub = gateway_pb2_grpc.GatewayStub(ch)
        alone_results = await answers(stub, {(p.prompt, p.lora) for p in plans}, max_tokens)
        alone = {k: r.tokens for k, r in alone_results.items()}
        churn0, rss0 = stack.churn(), stack.rss()
        t0 = time.monotonic()
        results = await asyncio.gather(*[run_stream(stub, p) for p in plans])
        wall = time.monotonic() - t0
    check_results(results, alone, problems)
    leaks = stack.wait_no_leaks()
    problems += [f"leak: {k} = {v} after every stream ended" for k, v in leaks.items() if v]
    churn = {k: v - churn0[k] for k, v in stack.churn().items()}
    rss_growth = {k: v - rss0.get(k, 0) for k, v in stack.rss().items()}
    return dict(summarize(results), streams=len(plans), wall_s=wall, leaks=leaks, churn=churn,
                rss_growth_bytes=rss_growth,
                alone_e2e_s=percentiles([r.ended - r.sent for r in alone_results.values()]),
                cancels=sum(p.cancel_after is not None for p in plans),
                deadlines=sum(p.deadline_s is not None for p in plans), problems=problems)


def streams(stack: Stack, num: int, adapters: list[str], *, max_tokens: int = 8, num_prompts: int = 16,
            cancel_frac: float = 0.2, deadline_frac: float = 0.2, seed: int = 0) -> dict[str, Any]:
    """`num` concurrent streams over base + `adapters`, with random client cancels and deadlines."""
    plans = make_plans(num, [None, *adapters], max_tokens, num_prompts=num_prompts, cancel_frac=cancel_frac,
                       deadline_frac=deadline_frac, seed=seed)
    return asyncio.run(_streams(stack, plans, max_tokens))


def small_pool(stack: Stack, num: int, adapters: list[str], *, max_tokens: int = 16, num_prompts: int = 8,
               max_e2e_s: float = 30.0, seed: int = 1) -> dict[str, Any]:
    """`num` concurrent streams over more adapters than the replica's adapter pool holds at once, none
    cancelled: every output equals its alone run, adapters were evicted and loaded again, and every
    stream ended within `max_e2e_s`."""
    plans = make_plans(num, [None, *adapters], max_tokens, num_prompts=num_prompts, cancel_frac=0.0,
                       deadline_frac=0.0, seed=seed)
    out = asyncio.run(_streams(stack, plans, max_tokens))
    if not out["churn"]["adapter_evictions"]:
        out["problems"].append("no adapter was evicted: the pool held the whole working set")
    worst = out["e2e_s"]["max"]
    if worst is None or worst > max_e2e_s:
        out["problems"].append(f"the slowest stream took {worst}s (bound {max_e2e_s}s)")
    return out


async def _stalled(stack: Stack, num_beside: int, max_tokens: int, stalled_tokens: int) -> dict[str, Any]:
    problems: list[str] = []
    beside = make_plans(num_beside, [None], max_tokens, num_prompts=num_beside, cancel_frac=0, deadline_frac=0,
                        seed=7)
    gw_rss0 = rss_bytes(stack.gateway.proc.pid)
    async with channel(stack.address) as ch, channel(stack.address, window_bytes=16 << 10) as stalled_ch:
        stub = gateway_pb2_grpc.GatewayStub(ch)
        t0 = time.monotonic()
        await asyncio.gather(*[run_stream(stub, p) for p in beside])
        alone_s = time.monotonic() - t0
        # the stalled client: its own connection, reads one message, then nothing
        req = build_generate_request([65, 66, 67], [], max_tokens=stalled_tokens, ignore_eos=True)
        call = gateway_pb2_grpc.GatewayStub(stalled_ch).Generate(req)
        got = list((await call.read()).token_ids)
        t0 = time.monotonic()
        await asyncio.gather(*[run_stream(stub, p) for p in beside])
        beside_s = time.monotonic() - t0
        # the gateway ends it on compute once its buffer is full, long before max_tokens
        t_end = time.monotonic() + 120
        while (still_running := stack.num_running()) and time.monotonic() < t_end:
            await asyncio.sleep(0.1)
        gw_rss1 = rss_bytes(stack.gateway.proc.pid)
        code, detail = "OK", ""
        try:
            while (msg := await call.read()) != grpc.aio.EOF:
                got += msg.token_ids
        except grpc.aio.AioRpcError as exc:
            code, detail = exc.code().name, exc.details() or ""
    if still_running:
        problems.append("the stalled stream still runs on compute: the gateway buffers without bound")
    if code != "RESOURCE_EXHAUSTED":
        problems.append(f"the stalled stream ended {code} after {len(got)} tokens, not RESOURCE_EXHAUSTED")
    if beside_s > 2.0 * alone_s + 0.5:
        problems.append(f"streams beside a stalled reader took {beside_s:.2f}s, alone {alone_s:.2f}s")
    leaks = stack.wait_no_leaks()
    problems += [f"leak: {k} = {v}" for k, v in leaks.items() if v]
    return dict(stalled_max_tokens=stalled_tokens, stalled_tokens_delivered=len(got), stalled_code=code,
                stalled_detail=detail,
                beside_streams=num_beside, beside_s=beside_s, alone_s=alone_s,
                gateway_rss_growth_bytes=gw_rss1 - gw_rss0, leaks=leaks, problems=problems)


def stalled_reader(stack: Stack, *, num_beside: int = 16, max_tokens: int = 32, stalled_tokens: int = 12000
                   ) -> dict[str, Any]:
    return asyncio.run(_stalled(stack, num_beside, max_tokens, stalled_tokens))


async def _kill_compute(stack: Stack, num_streams: int, num_after: int, max_tokens: int, adapters: list[str],
                        num_burst: int, error_bound_s: float) -> dict[str, Any]:
    problems: list[str] = []
    victim = stack.computes[0]
    plans = make_plans(num_streams, [None], max_tokens, num_prompts=num_streams, cancel_frac=0, deadline_frac=0,
                       seed=11)
    burst = make_plans(num_burst, [None, *adapters], 8, num_prompts=8, cancel_frac=0, deadline_frac=0, seed=12)
    async with channel(stack.address) as ch:
        stub = gateway_pb2_grpc.GatewayStub(ch)
        alone = {k: r.tokens for k, r in (await answers(stub, {(p.prompt, p.lora) for p in burst}, 8)).items()}
        started = asyncio.Event()
        firsts = 0

        runs = {p.index: Result(p) for p in plans}

        async def tracked(res: Result) -> None:
            nonlocal firsts
            req = build_generate_request(list(res.plan.prompt), [], max_tokens=res.plan.max_tokens, ignore_eos=True)
            res.sent = time.monotonic()
            try:
                async for msg in stub.Generate(req):
                    res.ended = time.monotonic()     # the last message so far
                    if res.first is None:
                        res.first = res.ended
                        firsts += 1
                        if firsts == len(plans):
                            started.set()
                    res.tokens += msg.token_ids
                res.code = "ENDED"                   # 4000 tokens: should not end during the scenario
            except grpc.aio.AioRpcError as exc:
                res.code, res.detail = exc.code().name, exc.details() or ""
                res.ended = time.monotonic()

        tasks = [asyncio.create_task(tracked(r)) for r in runs.values()]
        await asyncio.wait_for(started.wait(), 120)
        on_victim = stack.compute_stats(victim).num_running
        # short requests over base and adapters arrive as the replica dies: the ones that had no tokens yet
        # are retried on the other replica, the others end with UNAVAILABLE
        burst_tasks = [asyncio.create_task(run_stream(stub, p)) for p in burst]
        await asyncio.sleep(0.05)
        killed_at = await asyncio.to_thread(stack.kill, victim)
        # the victim's streams end; the others keep streaming (checked, then cancelled)
        t_end = time.monotonic() + 5
        while sum(t.done() for t in tasks) < on_victim and time.monotonic() < t_end:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.3)      # a stream that should not end would have ended by now
        failed = [r for r, t in zip(runs.values(), tasks) if t.done()]
        kept = [r for r, t in zip(runs.values(), tasks) if not t.done()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        burst_results = await asyncio.gather(*burst_tasks)
        after = await asyncio.gather(*[run_stream(stub, Plan(-1, (70, 71, i % 200 + 3), None, 4))
                                       for i in range(num_after)])
    burst_codes: dict[str, int] = {}
    for r in burst_results:
        burst_codes[r.code] = burst_codes.get(r.code, 0) + 1
        if r.code == "UNAVAILABLE" and victim.address in r.detail:
            continue
        if r.code != "OK" or r.tokens != alone[(r.plan.prompt, r.plan.lora)]:
            problems.append(f"a request sent as the replica died ended {r.code} with {r.tokens} "
                            f"(alone {alone[(r.plan.prompt, r.plan.lora)]}): {r.detail[:300]}")
    to_error = [r.ended - killed_at for r in failed]
    for r in failed:
        if r.code != "UNAVAILABLE" or victim.address not in r.detail:
            problems.append(f"a stream on the killed replica ended {r.code}: {r.detail[:300]}")
    if len(failed) != on_victim:
        problems.append(f"{len(failed)} streams ended, {on_victim} ran on the killed replica")
    if to_error and max(to_error) > error_bound_s:
        problems.append(f"streams on the killed replica heard of it after {max(to_error):.2f}s "
                        f"(bound {error_bound_s:g} s)")
    if any(r.ended < killed_at for r in kept):
        problems.append("a stream on the surviving replica stopped streaming at the kill")
    bad_after = [r for r in after if r.code != "OK" or len(r.tokens) != 4]
    if bad_after:
        problems.append(f"{len(bad_after)} of {num_after} requests after the kill failed: "
                        f"{bad_after[0].code} {bad_after[0].detail[:300]}")
    leaks = stack.wait_no_leaks()
    problems += [f"leak: {k} = {v}" for k, v in leaks.items() if v]
    return dict(streams=num_streams, on_killed_replica=on_victim, kept_streaming=len(kept),
                kill_to_error_s=percentiles(to_error), burst_at_kill=burst_codes,
                requests_after=num_after, failed_after=len(bad_after), leaks=leaks, problems=problems)


def kill_compute(stack: Stack, adapters: list[str], *, num_streams: int = 8, num_burst: int = 64,
                 num_after: int = 8, max_tokens: int = 4000, error_bound_s: float = 1.0) -> dict[str, Any]:
    """SIGKILL of `stack.computes[0]` while `num_streams` long base streams run over two replicas and
    `num_burst` short ones over base + `adapters` arrive; the killed replica's streams must hear of it
    within `error_bound_s`."""
    return asyncio.run(_kill_compute(stack, num_streams, num_after, max_tokens, adapters, num_burst,
                                     error_bound_s))


async def _load_loop(stub: gateway_pb2_grpc.GatewayStub, root: str, names: list[str], stop: asyncio.Event,
                     codes: dict[str, int], details: list[str]) -> None:
    """LoadLora of `names` from the server-side root, again and again (replace), until `stop`."""
    i = 0
    while not stop.is_set():
        name = names[i % len(names)]
        i += 1
        try:
            await stub.LoadLora(gateway_pb2.LoadLoraRequest(path=f"{root}/{name}", name=f"load-{name}",
                                                            replace=True), timeout=30)
            codes["OK"] = codes.get("OK", 0) + 1
        except grpc.aio.AioRpcError as exc:
            code = exc.code().name
            codes[code] = codes.get(code, 0) + 1
            if code != "UNAVAILABLE":
                details.append(f"LoadLora {name}: {code}: {exc.details()}")
            await asyncio.sleep(0.01)


async def _kill_cache(stack: Stack, fresh: list[str], recover_timeout_s: float) -> dict[str, Any]:
    problems: list[str] = []
    async with channel(stack.address) as ch:
        stub = gateway_pb2_grpc.GatewayStub(ch)
        stop, codes, details = asyncio.Event(), {}, []
        loaders = [asyncio.create_task(_load_loop(stub, str(stack.lora_root), fresh, stop, codes, details))
                   for _ in range(4)]
        while codes.get("OK", 0) < 4:               # loads are going on
            await asyncio.sleep(0.01)
        killed_at = await asyncio.to_thread(stack.kill, stack.cache)
        await asyncio.sleep(0.5)
        stop.set()
        await asyncio.gather(*loaders)
        down_codes = dict(codes)
        # while it is down: an adapter the compute service does not hold needs the cache
        down = await run_stream(stub, Plan(-1, (80, 81, 82), fresh[-1], 4, deadline_s=30))
        base = await run_stream(stub, Plan(-1, (80, 81, 82), None, 4, deadline_s=30))
        restarted_at = time.monotonic()
        await asyncio.to_thread(stack.restart_cache)
        listening_s = time.monotonic() - restarted_at
        recovered, last = None, None
        while time.monotonic() - restarted_at < recover_timeout_s:
            last = await run_stream(stub, Plan(-1, (80, 81, 82), fresh[-1], 4, deadline_s=30))
            if last.code == "OK":
                recovered = time.monotonic() - restarted_at
                break
            await asyncio.sleep(0.1)
        loads_after = {}
        for name in fresh:
            try:
                await stub.LoadLora(gateway_pb2.LoadLoraRequest(path=f"{stack.lora_root}/{name}"), timeout=30)
                loads_after["OK"] = loads_after.get("OK", 0) + 1
            except grpc.aio.AioRpcError as exc:
                loads_after[exc.code().name] = loads_after.get(exc.code().name, 0) + 1
    problems += details[:5]
    if not down_codes.get("UNAVAILABLE"):
        problems.append(f"no load in flight saw the kill as UNAVAILABLE: {down_codes}")
    if down.code != "UNAVAILABLE":
        problems.append(f"a request needing the dead cache ended {down.code}: {down.detail[:300]}")
    if base.code != "OK":
        problems.append(f"a base request while the cache was down ended {base.code}: {base.detail[:300]}")
    if recovered is None:
        problems.append(f"no adapter served {recover_timeout_s:.0f}s after the cache restarted: "
                        f"{last.code if last else None} {last.detail[:300] if last else ''}")
    if set(loads_after) != {"OK"}:
        problems.append(f"loads after the restart: {loads_after}")
    leaks = stack.wait_no_leaks()
    problems += [f"leak: {k} = {v}" for k, v in leaks.items() if v]
    return dict(loads_while_killed=down_codes, killed_at=killed_at, restart_listening_s=listening_s,
                recovered_after_restart_s=recovered, loads_after_restart=loads_after, leaks=leaks,
                problems=problems)


def kill_cache(stack: Stack, fresh: list[str], *, recover_timeout_s: float = 20.0) -> dict[str, Any]:
    """SIGKILL of the cache service while `fresh` adapters (in the root, never used yet) load."""
    return asyncio.run(_kill_cache(stack, fresh, recover_timeout_s))


async def _restart_redis(stack: Stack, fresh: list[str], recover_timeout_s: float) -> dict[str, Any]:
    problems: list[str] = []
    async with channel(stack.address) as ch:
        stub = gateway_pb2_grpc.GatewayStub(ch)
        before = await run_stream(stub, Plan(-1, (90, 91), fresh[0], 4, deadline_s=30))
        await asyncio.to_thread(stack.redis.proc.kill)
        await asyncio.to_thread(stack.redis.proc.wait, 10)
        down = await run_stream(stub, Plan(-1, (90, 91), fresh[1], 4, deadline_s=30))
        base = await run_stream(stub, Plan(-1, (90, 91), None, 4, deadline_s=30))
        restarted_at = time.monotonic()
        await asyncio.to_thread(stack.restart_redis)
        recovered, last = None, None
        while time.monotonic() - restarted_at < recover_timeout_s:
            last = await run_stream(stub, Plan(-1, (90, 91), fresh[1], 4, deadline_s=30))
            if last.code == "OK":
                recovered = time.monotonic() - restarted_at
                break
            await asyncio.sleep(0.1)
    if before.code != "OK":
        problems.append(f"before the restart: {before.code} {before.detail[:300]}")
    if down.code != "UNAVAILABLE":
        problems.append(f"a request needing redis while it was down ended {down.code}: {down.detail[:300]}")
    if base.code != "OK":
        problems.append(f"a base request while redis was down ended {base.code}: {base.detail[:300]}")
    if recovered is None:
        problems.append(f"no adapter served {recover_timeout_s:.0f}s after redis restarted: "
                        f"{last.code if last else None} {last.detail[:300] if last else ''}")
    leaks = stack.wait_no_leaks()
    problems += [f"leak: {k} = {v}" for k, v in leaks.items() if v]
    return dict(down_code=down.code, recovered_after_restart_s=recovered, leaks=leaks, problems=problems)


def restart_redis(stack: Stack, fresh: list[str], *, recover_timeout_s: float = 20.0) -> dict[str, Any]:
    """redis-server killed and restarted empty; `fresh[0]` serves before, `fresh[1]` is first asked while down."""
    return asyncio.run(_restart_redis(stack, fresh, recover_timeout_s))
