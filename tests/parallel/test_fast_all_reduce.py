"""The all-reduce path's switch: an unknown LORAPLEX_TP_ALL_REDUCE is refused on every device (a typo must
not silently pick a path), and the CPU and a single rank never take the peer-memory path."""
import pytest
import torch

from compute_service.parallel.fast_all_reduce import ENV, MAX_FUSED_ROWS, MODES, try_peer_all_reduce


def _never(_: int) -> int:
    raise AssertionError("the ranks are not asked to agree off the GPU path")


def test_an_unknown_mode_is_refused(monkeypatch):
    monkeypatch.setenv(ENV, "fused")
    with pytest.raises(ValueError, match="use one of auto, oneshot, nccl"):
        try_peer_all_reduce(None, torch.device("cpu"), 2, _never)


@pytest.mark.parametrize("mode", MODES)
def test_cpu_and_one_rank_stay_off_the_peer_path(monkeypatch, mode):
    monkeypatch.setenv(ENV, mode)
    assert try_peer_all_reduce(None, torch.device("cpu"), 2, _never) is None
    assert try_peer_all_reduce(None, torch.device("cuda", 0), 1, _never) is None


def test_fused_rows_fit_one_wave():
    """Every program of a fused launch waits for its peers' programs, so all must be resident at once."""
    assert MAX_FUSED_ROWS * 8 <= 132 * 64 // 4          # 8-warp programs against a quarter of an H100's warps
