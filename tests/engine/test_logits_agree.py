"""`helpers.assert_logits_agree` and `helpers.assert_same_logits`, the GPU tests' comparisons of two runs' logits:
tie-aware, so that correct code whose two runs break a near tie differently passes, while logits apart, or different
choices without a tie, fail."""
from __future__ import annotations

import pytest
import torch

from helpers import assert_logits_agree, assert_same_logits


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


def _runs(tokens, rows, base_rows):
    return {("r", "k"): (tokens, rows), ("r", None): ([0] * len(base_rows), base_rows)}


def test_same_logits_tie_at_the_first_step_passes():
    """`helpers.assert_same_logits` (runs keyed by request and adapter): a near tie broken differently at the first
    step ends the comparison there, without the minimum of compared steps."""
    a, b = torch.tensor([1.0, 0.995, -1.0]), torch.tensor([0.99, 1.0, -1.0])
    base = [torch.tensor([-1.0, 0.0, 1.0])] * 3
    assert_same_logits(_runs([0, 2, 2], [a, a, a], base), _runs([1, 0, 0], [b, base[0], base[0]], base))


@pytest.mark.parametrize("tokens,rows", [([1, 0, 0], [torch.tensor([1.0, 0.5, -1.0])] * 3),     # no tie
                                         ([0, 0], [torch.tensor([1.0, 0.5, -1.0])] * 2)])        # too few steps
def test_same_logits_real_differences_fail(tokens, rows):
    base = [torch.tensor([-1.0, 0.0, 1.0])] * 3
    first = _runs([0, 0, 0], [torch.tensor([1.0, 0.5, -1.0])] * 3, base)
    with pytest.raises(AssertionError):
        assert_same_logits(first, _runs(tokens, rows, base))


def test_same_logits_an_adapter_that_moves_nothing_fails():
    rows = [torch.tensor([1.0, 0.5, -1.0])] * 3
    with pytest.raises(AssertionError, match="move the logits"):
        assert_same_logits(_runs([0, 0, 0], rows, rows), _runs([0, 0, 0], rows, rows))
