"""The shared-memory step channel: messages in order, large ones over the fallback, acks gate the
writer, and a dead peer (exited or a zombie) ends a wait with an error instead of a hang."""
from __future__ import annotations

import os
import queue
import subprocess
import threading
import time

import numpy as np
import pytest

from compute_service.parallel.step_channel import StepChannel, _alive

pytestmark = pytest.mark.serial


def _pair(tmp_path, capacity=1 << 12, spin=False):
    path = StepChannel.create(capacity, folder=str(tmp_path))
    side: queue.Queue = queue.Queue()
    writer = StepChannel(path, 0, 2, capacity, spin=spin, fallback_send=side.put, fallback_receive=side.get)
    reader = StepChannel(path, 1, 2, capacity, spin=spin, fallback_send=side.put,
                         fallback_receive=lambda: side.get(timeout=10))
    os.unlink(path)                    # as the group does: the mappings outlive the name
    return writer, reader


@pytest.mark.parametrize("spin", [False, True])
def test_messages_arrive_in_order_small_and_large(tmp_path, spin):
    writer, reader = _pair(tmp_path, spin=spin)
    rng = np.random.default_rng(0)
    sent = [{"i": i, "ids": rng.integers(0, 1000, size=int(rng.integers(1, 50))).tolist()} for i in range(200)]
    sent[50]["blob"] = bytes(rng.integers(0, 256, size=1 << 14, dtype=np.uint8))   # over the 4 KiB slot
    got = []
    t = threading.Thread(target=lambda: got.extend(reader.receive(10.0) for _ in sent))
    t.start()
    for m in sent:
        writer.send(m, 10.0)
    t.join(20)
    assert got == sent


def test_the_writer_waits_for_the_reader_to_take_the_previous_message(tmp_path):
    writer, reader = _pair(tmp_path)
    writer.send("first", 5.0)
    done = threading.Event()
    t = threading.Thread(target=lambda: (writer.send("second", 5.0), done.set()))
    t.start()
    time.sleep(0.2)
    assert not done.is_set()             # "first" not read yet: the slot is not overwritten
    assert reader.receive(5.0) == "first"
    t.join(5)
    assert done.is_set() and reader.receive(5.0) == "second"


def test_a_wait_times_out_with_an_error(tmp_path):
    _writer, reader = _pair(tmp_path)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="waited"):
        reader.receive(0.3)
    assert time.monotonic() - t0 < 5


def test_a_dead_peer_ends_the_wait(tmp_path):
    writer, reader = _pair(tmp_path)
    gone = subprocess.Popen(["true"])
    gone.wait()
    reader._words[8 + 64 + 0] = gone.pid            # rank 0's pid word: a process that has exited
    with pytest.raises(RuntimeError, match="rank 0 .* is gone"):
        reader.receive(60.0)
    writer.send("one", 5.0)                         # the reader never acks it
    writer._words[8 + 64 + 1] = gone.pid
    with pytest.raises(RuntimeError, match="rank 1 .* is gone"):
        writer.send("two", 60.0)


def test_a_zombie_counts_as_dead():
    child = subprocess.Popen(["true"])
    deadline = time.monotonic() + 10
    while _alive(child.pid) and time.monotonic() < deadline:   # exited, not reaped: a zombie
        time.sleep(0.01)
    assert not _alive(child.pid)
    child.wait()
    assert _alive(os.getpid())
