"""`graph_capture.graph_forward`: the forwards that stand for a captured graph (the capture's warm run, the
warm-up's decode forwards) take the graph's paths on this thread only, and the flag is restored after."""
from __future__ import annotations

import threading

import pytest

from compute_service.engine.graph_capture import graph_forward, in_graph_forward


def test_graph_forward_is_per_thread_and_restored():
    assert not in_graph_forward()
    seen = []
    with graph_forward():
        assert in_graph_forward()
        other = threading.Thread(target=lambda: seen.append(in_graph_forward()))
        other.start()
        other.join()
        with graph_forward():
            assert in_graph_forward()
        assert in_graph_forward()                    # a nested use leaves the outer one on
    assert seen == [False] and not in_graph_forward()
    with pytest.raises(RuntimeError):
        with graph_forward():
            raise RuntimeError("a failed forward")
    assert not in_graph_forward()
