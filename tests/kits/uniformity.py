"""Uniformity of masked data for the secure-aggregation tests.

The masks come from fresh keys (os.urandom through `cryptography`), so a masked row differs on
every run and a test of it is a statistical test. Its level decides how often a correct mask
fails: each test file makes up to ten of these checks per run and CI runs many times, so at 1e-4
a correct mask failed about one CI run in a thousand. At 1e-9 that is one in ~10^8 runs, while a
leak still fails at once: an unmasked constant row (all bytes from one or two values) gives
p = 0, and a row whose mask covers only half the elements gives p < 1e-300 over 16,000 bytes."""

from __future__ import annotations

import numpy as np
from scipy import stats

LEVEL = 1e-9  # the p-value below which the bytes are called not uniform


def uniform_pvalue(counts: np.ndarray) -> float:
    """Chi-square p-value of `counts` (`(256,)` int, a histogram) against the uniform histogram."""
    return float(stats.chisquare(counts).pvalue)


def assert_bytes_uniform(values: np.ndarray) -> None:
    """Assert that the bytes of `values` (any dtype, C-contiguous) look uniform on 0..255."""
    counts = np.bincount(np.ascontiguousarray(values).view(np.uint8).ravel(), minlength=256)
    p = uniform_pvalue(counts)
    assert p > LEVEL, f"bytes not uniform: chi-square p = {p:.3g} over {counts.sum()} bytes"


def assert_top_bits_uniform(values: np.ndarray) -> None:
    """Assert that the top 8 bits of `values` (`(n,)` uint32) look uniform on 0..255."""
    counts = np.bincount((np.asarray(values, dtype=np.uint32) >> 24).astype(np.int64), minlength=256)
    p = uniform_pvalue(counts)
    assert p > LEVEL, f"top 8 bits not uniform: chi-square p = {p:.3g} over {values.size} values"
