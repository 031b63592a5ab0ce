"""The engine thread: it hands step N's tokens over once step N+1's GPU work is queued, and at once when
nothing follows; the step trace records every step; served tokens are the engine's either way; if the
thread stops on an error, every request fails with UNAVAILABLE and new ones are refused."""
from __future__ import annotations

import asyncio
import json
import threading

import pytest

from loraplex.errors import UnavailableError

from compute_service.build import build_runtime
from compute_service.config import ComputeConfig
from compute_service.engine.sampling_params import SamplingParams
from compute_service.step_loop import Admission


def runtime(loaded, tiny_model_dir, **flags):
    async def fetch(task_id, version):
        raise AssertionError("no adapter is fetched here")

    cfg = ComputeConfig(model=str(tiny_model_dir), device="cpu", dtype="float32", max_lora_rank=8,
                        lora_gpu_cache_bytes=1 << 20, max_model_len=96, max_num_batched_tokens=128,
                        max_num_seqs=8, kv_cache_bytes=1 << 20, **flags)
    return build_runtime(cfg, fetch, loaded=loaded)


class RecordingLoop:
    """Stands in for the event loop: notes what the engine thread was doing at each hand-off, then drains."""

    def __init__(self, rt) -> None:
        self.rt = rt
        self.in_step = False
        self.handoffs: list[tuple[bool, int]] = []     # (inside engine.step, batches queued)
        self.tokens: list[int] = []
        self.finished = threading.Event()

    def call_soon_threadsafe(self, fn) -> None:
        self.handoffs.append((self.in_step, len(self.rt.runner.steps.ready)))
        fn()

    def drain(self) -> None:
        ready = self.rt.runner.steps.ready
        while ready:
            for out in ready.popleft().outputs:
                self.tokens += out.new_token_ids
                if out.finished:
                    self.finished.set()


def test_a_step_is_handed_over_during_the_next_steps_launch_the_first_and_last_at_once(loaded, tiny_model_dir):
    rt = runtime(loaded, tiny_model_dir)
    loop = RecordingLoop(rt)
    steps = rt.runner.steps
    steps._on_ready = loop.drain
    step = rt.engine.step

    def traced_step():
        loop.in_step = True
        try:
            return step()
        finally:
            loop.in_step = False
    rt.engine.step = traced_step
    steps.start(loop)
    try:
        steps.submit(lambda: steps.add(Admission("r", [1, 2, 3, 4], SamplingParams(max_tokens=6, ignore_eos=True))))
        assert loop.finished.wait(30)
    finally:
        steps.stop()
    assert len(loop.tokens) == 6
    assert loop.handoffs[0] == (False, 1)       # the prefill's first token: handed over at once, a TTFT
    running = loop.handoffs[1:-1]
    assert len(running) >= 4 and all(in_step and queued == 1 for in_step, queued in running)
    assert loop.handoffs[-1] == (False, 1)      # the last step's tokens: nothing follows, handed over at once
    assert rt.engine.on_launched is None        # a stopped loop leaves the engine as it found it


@pytest.mark.parametrize("handoff", ["launch", "read", "step_end"])
def test_served_tokens_equal_the_engines_and_the_trace_has_every_step(loaded, tiny_model_dir, tmp_path, handoff):
    trace = tmp_path / "steps.json"
    params = SamplingParams(max_tokens=7, ignore_eos=True)
    prompts = [[1 + i, 5, 9, 2 + i] for i in range(3)]

    async def serve() -> list[list[int]]:
        rt = runtime(loaded, tiny_model_dir, step_handoff=handoff, step_trace=str(trace))
        rt.runner.start()

        async def one(i: int) -> list[int]:
            return [t for out in [o async for o in rt.runner.generate(f"r{i}", prompts[i], params)]
                    for t in out.new_token_ids]
        try:
            return list(await asyncio.gather(*(one(i) for i in range(3))))
        finally:
            await rt.runner.stop()
    got = asyncio.run(serve())

    ref = runtime(loaded, tiny_model_dir).engine
    for i, p in enumerate(prompts):
        ref.add_request(f"r{i}", p, params)
    want: dict[str, list[int]] = {f"r{i}": [] for i in range(3)}
    while ref.has_unfinished():
        for out in ref.step():
            want[out.request_id] += out.new_token_ids
    assert got == [want[f"r{i}"] for i in range(3)]
    steps = json.loads(trace.read_text())
    assert len(steps["start"]) == len(steps["end"]) == len(steps["tokens"]) >= 7
    assert sum(steps["tokens"]) == 21
    assert all(s <= q <= e for s, q, e in zip(steps["start"], steps["launched"], steps["end"]))


def test_an_engine_thread_that_dies_fails_its_requests_as_unavailable_and_refuses_new_ones(
        loaded, tiny_model_dir, caplog):
    async def serve() -> None:
        rt = runtime(loaded, tiny_model_dir)
        pump, calls = rt.slots.pump, [0]

        def failing_pump() -> None:       # something a step does not catch, a few steps into a request
            calls[0] += 1
            if calls[0] > 4:
                raise RuntimeError("device lost")
            pump()
        rt.slots.pump = failing_pump
        rt.runner.start()
        try:
            with pytest.raises(UnavailableError, match="device lost.*restart"):
                async for _ in rt.runner.generate("r", [1, 2, 3], SamplingParams(max_tokens=50, ignore_eos=True)):
                    pass
            with pytest.raises(UnavailableError):
                async for _ in rt.runner.generate("r2", [1, 2, 3], SamplingParams(max_tokens=2)):
                    pass
            with pytest.raises(UnavailableError):
                await rt.runner.snapshot()
        finally:
            await asyncio.wait_for(rt.runner.stop(), 10)
    asyncio.run(asyncio.wait_for(serve(), 30))
    assert any("the engine thread stopped: device lost" in r.getMessage() for r in caplog.records)


class ColumnarConsumer:
    """Takes unfinished deltas as columns (as a token session does) and the last one through deliver;
    records on which thread each call ran."""

    columnar = True

    def __init__(self) -> None:
        self.tokens: dict[int, list[int]] = {}
        self.column_calls = 0
        self.finished: list[int] = []
        self.done = asyncio.Event()
        self.threads: set[str] = set()

    def deliver_columns(self, handles, counts, tokens) -> None:
        self.threads.add(threading.current_thread().name)
        self.column_calls += 1
        pos = 0
        for h, n in zip(handles, counts):
            self.tokens.setdefault(h, []).extend(tokens[pos:pos + n])
            pos += n

    def deliver(self, handle, out) -> None:
        self.threads.add(threading.current_thread().name)
        assert out.finished, "a columnar consumer gets only last deltas one by one"
        self.tokens.setdefault(handle, []).extend(out.new_token_ids)
        self.finished.append(handle)
        if len(self.finished) == 3:
            self.done.set()

    def fail(self, handle, exc) -> None:
        raise AssertionError(f"request {handle} failed: {exc}")

    def end_batch(self) -> None:
        pass


class Timings:
    """A SequenceObserver that records the thread it is called on."""

    def __init__(self) -> None:
        self.threads: set[str] = set()
        self.tokens = 0
        self.steady_calls = 0

    def delivered(self, req, out, now) -> None:
        self.threads.add(threading.current_thread().name)
        self.tokens += len(out.new_token_ids)
        req.last_token_at = now

    def steady(self, seconds, n) -> None:
        self.threads.add(threading.current_thread().name)
        assert seconds > 0
        self.tokens += n
        self.steady_calls += 1


def test_columnar_consumers_get_the_engines_tokens_grouped_per_step_and_timings_on_the_engine_thread(
        loaded, tiny_model_dir):
    params = SamplingParams(max_tokens=7, ignore_eos=True)
    prompts = [[1 + i, 5, 9, 2 + i] for i in range(3)]

    async def serve():
        rt = runtime(loaded, tiny_model_dir)
        timings = Timings()
        rt.runner.latency = timings
        rt.runner.start()
        consumer = ColumnarConsumer()
        try:
            for i, p in enumerate(prompts):
                rt.runner.start_request(f"r{i}", p, params, None, "", consumer, 100 + i)
            await asyncio.wait_for(consumer.done.wait(), 30)
        finally:
            await rt.runner.stop()
        return consumer, timings

    consumer, timings = asyncio.run(serve())
    ref = runtime(loaded, tiny_model_dir).engine
    for i, p in enumerate(prompts):
        ref.add_request(f"r{i}", p, params)
    want: dict[int, list[int]] = {100 + i: [] for i in range(3)}
    while ref.has_unfinished():
        for out in ref.step():
            want[100 + int(out.request_id[1:])] += out.new_token_ids
    assert consumer.tokens == want and sorted(consumer.finished) == [100, 101, 102]
    assert consumer.column_calls >= 5                 # 6 unfinished deltas each, a few steps per drain at most
    assert consumer.threads == {"MainThread"}         # the event loop's thread
    assert timings.threads == {"engine-steps"} and timings.tokens == 21
    assert timings.steady_calls >= 3              # decode steps: one observation for the batch
