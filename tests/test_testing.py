"""lightning_bppsa.testing: the derived-tolerance helper accepts what flush-to-zero explains, nothing more."""

import pytest
import torch

from lightning_bppsa.testing import assert_derived_close


def test_a_result_entirely_in_the_denormal_range_may_be_flushed_to_zero():
    reference = torch.full((5,), 1e-44, dtype=torch.float64)
    assert_derived_close(torch.zeros(5), reference)  # float32 flush-to-zero


def test_normal_range_differences_and_nan_still_fail():
    reference = torch.full((5,), 1e-30, dtype=torch.float64)  # a normal float32 number
    with pytest.raises(AssertionError, match="relative error"):
        assert_derived_close(torch.zeros(5), reference)
    with pytest.raises(AssertionError, match="relative error"):
        assert_derived_close(torch.full((5,), float("nan")), torch.ones(5, dtype=torch.float64))
    with pytest.raises(AssertionError, match="relative error"):
        assert_derived_close(
            torch.ones(5, dtype=torch.float64) * (1 + 1e-9), torch.ones(5, dtype=torch.float64)
        )


def test_a_few_flushed_terms_per_element_pass_and_more_fail():
    """Seen in the fuzz test (LSTM, 257 steps): gradients ~1e-37 off by up to ~2.3x float32's tiny per element."""
    tiny = torch.finfo(torch.float32).tiny
    reference = torch.full((16,), 8 * tiny, dtype=torch.float64)
    assert_derived_close((reference - 3 * tiny).float(), reference)
    with pytest.raises(AssertionError, match="relative error"):
        assert_derived_close((reference - 5 * tiny).float(), reference)
