"""`graph_capture.graph_forward`: the forwards that stand for a captured graph (the capture's warm run, the
warm-up's decode forwards) take the graph's paths on this thread only, and the flag is restored after; the
bound on the token count of those paths' LoRA overlap (`model.overlap_tokens`)."""
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


def test_overlap_tokens_default_and_setting(monkeypatch):
    from compute_service.engine.model import LORA_OVERLAP_TOKENS, OVERLAP_TOKENS_ENV, overlap_tokens

    monkeypatch.delenv(OVERLAP_TOKENS_ENV, raising=False)
    assert overlap_tokens() == LORA_OVERLAP_TOKENS == 64
    monkeypatch.setenv(OVERLAP_TOKENS_ENV, "16")
    assert overlap_tokens() == 16
    for bad in ("0", "many"):
        monkeypatch.setenv(OVERLAP_TOKENS_ENV, bad)
        with pytest.raises(ValueError, match=OVERLAP_TOKENS_ENV):
            overlap_tokens()
