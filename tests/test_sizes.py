"""labkit._sizes: the sizes error messages suggest."""

import pytest

from labkit._sizes import divisors


def test_divisors_in_order_up_to_64_and_the_limit():
    assert divisors(100) == [1, 2, 4, 5, 10, 20, 25, 50]
    assert divisors(100, 3) == [1, 2, 4]
    assert divisors(1000, proper=True) == [2, 4, 5, 8, 10, 20, 25, 40]
    assert divisors(7, proper=True) == [] and divisors(7) == [1, 7]
    assert divisors(128) == [1, 2, 4, 8, 16, 32, 64]  # 128 itself is past the search


def test_multiples_near_names_the_multiples_on_either_side():
    from labkit._sizes import multiples_near

    assert multiples_near(10, 4) == "8 or 12"
    assert multiples_near(1000, 3) == "999 or 1002"
    assert multiples_near(3, 4) == "4"  # nothing below k: k itself


def test_positive_is_a_finite_real_above_zero_or_at_least_zero_when_asked():
    import numpy as np

    from labkit._sizes import positive

    assert positive(3, "x") == 3.0 and positive(np.float32(0.5), "x") == 0.5
    assert positive(0, "x", zero=True) == 0.0
    for bad in (0, -1, float("nan"), float("inf"), True, "1", None):
        with pytest.raises(ValueError, match=r"x must be a positive number, got"):
            positive(bad, "x")
    with pytest.raises(ValueError, match=r"^t must be a number of seconds >= 0, got -1 \(hint\)$"):
        positive(-1, "t", what="a number of seconds >= 0", zero=True, hint=" (hint)")
