"""`helpers.assert_logits_agree`, the GPU tests' comparison of two runs' logits: tie-aware, so that correct code
whose two runs break a near tie differently passes, while logits apart, or different choices without a tie, fail."""
from __future__ import annotations

import pytest
import torch

from helpers import assert_logits_agree


def test_a_tie_broken_differently_passes_and_ends_the_comparison():
    a, b = torch.tensor([1.0, 0.995, -1.0]), torch.tensor([0.99, 1.0, -1.0])
    far = torch.tensor([-5.0, 3.0, 9.0])        # after the choices part, nothing more is compared
    assert_logits_agree({"r": ([0, 2], [a, a])}, {"r": ([1, 0], [b, far])})


@pytest.mark.parametrize("second", [([1], [torch.tensor([1.0, 0.5, -1.0])]),          # a choice without a tie
                                    ([0], [torch.tensor([1.1, 0.55, -1.1])])])        # logits 10% apart
def test_a_real_difference_fails(second):
    with pytest.raises(AssertionError):
        assert_logits_agree({"r": ([0], [torch.tensor([1.0, 0.5, -1.0])])}, {"r": second})


def test_no_logits_fails():
    with pytest.raises(AssertionError, match="no logits"):
        assert_logits_agree({"r": ([], [])}, {"r": ([], [])})
