"""The gRPC side's end of the engine-process pipe (`compute_service.engine_link`), on a real pipe in one
process: the wire form of errors, `--engine-process auto`, and `RemoteRunner`'s bookkeeping."""
from __future__ import annotations

import asyncio
import multiprocessing
import pickle

import grpc
import pytest

from compute_service.config import ComputeConfig
from compute_service.engine.sampling_params import SamplingParams
from compute_service.engine_link import RemoteRunner, error_from_wire, error_wire
from compute_service.request_errors import DeadlineExceededError
from loraplex import errors
from loraplex.settings import SettingsError


class Collect:
    def __init__(self):
        self.got, self.failed, self.batches = [], [], 0

    def deliver(self, handle, out):
        self.got.append((handle, out.request_id, list(out.new_token_ids), out.finished, out.finish_reason))

    def fail(self, handle, exc):
        self.failed.append((handle, exc))

    def end_batch(self):
        self.batches += 1


@pytest.mark.parametrize("exc, code", [
    (errors.InvalidArgumentError("bad"), grpc.StatusCode.INVALID_ARGUMENT),
    (errors.NotFoundError("no adapter 7"), grpc.StatusCode.NOT_FOUND),
    (errors.ResourceExhaustedError("full"), grpc.StatusCode.RESOURCE_EXHAUSTED),
    (DeadlineExceededError("late"), grpc.StatusCode.DEADLINE_EXCEEDED),
    (RuntimeError("boom"), grpc.StatusCode.INTERNAL),
])
def test_errors_cross_the_pipe_with_their_code_and_message(exc, code):
    back = error_from_wire(*pickle.loads(pickle.dumps(error_wire(exc))))
    assert back.grpc_code == code
    assert str(exc) in str(back)


def test_engine_process_is_on_by_default_with_one_gpu_only():
    assert ComputeConfig().engine_process == "auto"
    assert ComputeConfig().uses_engine_process("cuda")
    assert not ComputeConfig().uses_engine_process("cpu")
    assert not ComputeConfig(tensor_parallel_size=2).uses_engine_process("cuda")     # auto: not with TP
    assert not ComputeConfig(engine_process="off").uses_engine_process("cuda")
    assert ComputeConfig(device="cpu", engine_process="on").uses_engine_process("cpu")   # not refused
    with pytest.raises(SettingsError, match="engine_process"):
        ComputeConfig(engine_process="yes")
    with pytest.raises(SettingsError, match="tensor_parallel_size"):
        ComputeConfig(engine_process="on", tensor_parallel_size=2)


class Columns(Collect):
    columnar = True

    def __init__(self):
        super().__init__()
        self.columns = []

    def deliver_columns(self, handles, counts, tokens):
        self.columns.append((list(handles), list(counts), list(tokens)))


def test_remote_runner_regroups_columns_per_consumer_and_drops_cancelled_handles():
    async def main():
        ours, theirs = multiprocessing.Pipe(duplex=True)
        runner = RemoteRunner(ours)
        a, b = Columns(), Columns()
        runner.start_request("r1", [1], SamplingParams(), None, "", a, 10)
        runner.start_request("r2", [1], SamplingParams(), None, "", b, 20)
        runner.start_request("r3", [1], SamplingParams(), None, "", a, 30)
        runner.start_request("r4", [1], SamplingParams(), None, "", a, 40)
        sent = [pickle.loads(theirs.recv_bytes()) for _ in range(4)]
        assert all(m[-1] is True for m in sent)      # columnar consumers: the engine groups their deltas
        h1, h2, h3, h4 = (m[1] for m in sent)
        runner.cancel("r4")
        runner.received(("batch", [(h3, [9], True, "stop", 1, 3)], [],
                         ([h1, h2, h4, h1], [1, 2, 1, 1], [5, 6, 7, 8, 4])))
        return a, b
    a, b = asyncio.run(main())
    assert a.columns == [([10, 10], [1, 1], [5, 4])] and b.columns == [([20], [2], [6, 7])]
    assert a.got == [(30, "r3", [9], True, "stop")] and a.batches == b.batches == 1


def test_remote_runner_routes_deltas_and_fails_everything_when_the_engine_is_lost():
    async def main():
        ours, theirs = multiprocessing.Pipe(duplex=True)
        runner = RemoteRunner(ours)
        a, b = Collect(), Collect()
        runner.start_request("r1", [1, 2], SamplingParams(max_tokens=2), None, "", a, 10)
        runner.start_request("r2", [3], SamplingParams(max_tokens=2), 5, "v", b, 20)
        with pytest.raises(errors.InvalidArgumentError, match="already running"):
            runner.start_request("r1", [1], SamplingParams(), None, "", a, 11)
        sent = [pickle.loads(theirs.recv_bytes()) for _ in range(2)]
        assert [m[0] for m in sent] == ["start", "start"]
        h1, h2 = sent[0][1], sent[1][1]
        assert sent[1][2:7] == ("r2", [3], SamplingParams(max_tokens=2), 5, "v")
        assert sent[0][-1] is False                  # Collect takes no columns
        runner.received(("batch", [(h1, [7], False, None, 2, 1), (h2, [8, 9], True, "length", 1, 2)], [],
                         ([], [], [])))
        assert a.got == [(10, "r1", [7], False, None)] and b.got == [(20, "r2", [8, 9], True, "length")]
        assert a.batches == b.batches == 1
        runner.start_request("r2", [3], SamplingParams(), None, "", b, 21)     # r2 ended: its id is free again
        assert pickle.loads(theirs.recv_bytes())[0] == "start"
        runner.cancel("r2")
        assert pickle.loads(theirs.recv_bytes())[::2] == ("cancel", "r2")
        stats = runner.snapshot()
        assert pickle.loads(theirs.recv_bytes())[0] == "call"
        runner.lost("exit code -9")
        assert len(a.failed) == 1 and isinstance(a.failed[0][1], errors.UnavailableError)
        with pytest.raises(errors.UnavailableError, match="engine process stopped"):
            await stats
        with pytest.raises(errors.UnavailableError):
            runner.start_request("r3", [1], SamplingParams(), None, "", a, 12)
        with pytest.raises(errors.UnavailableError):
            await runner.drop(3)
    asyncio.run(main())


def test_the_device_check_for_the_engine_process_needs_no_torch():
    import subprocess
    import sys
    from compute_service.engine_spawn import cuda_visible
    assert cuda_visible("cuda") and cuda_visible("cuda:1") and not cuda_visible("cpu")
    # the gRPC side spawns the engine process before it imports torch (start-up: the two import at once)
    code = ("import sys, compute_service.server, compute_service.engine_spawn as s; s.cuda_visible('auto'); "
            "assert 'torch' not in sys.modules, 'compute_service.server imports torch before the spawn'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
