"""The digits workload's data: read from scikit-learn's data file without importing scikit-learn,
and split exactly as `sklearn.model_selection.train_test_split(..., stratify=y)` splits it, so
every figure measured with the scikit-learn split holds."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from shoal.peer.workloads.digits import load_digits_arrays, load_digits_split, stratified_split


def test_the_arrays_are_scikit_learns_digits():
    from sklearn.datasets import load_digits

    data, target = load_digits_arrays()
    bunch = load_digits()
    assert data.shape == (1797, 64) and np.array_equal(data, bunch.data) and np.array_equal(target, bunch.target)


@pytest.mark.parametrize("seed", [0, 1, 7, 123])
@pytest.mark.parametrize("fraction", [0.2, 0.33])
def test_the_split_is_train_test_split_stratified(seed, fraction):
    from sklearn.model_selection import train_test_split

    _, y = load_digits_arrays()
    train, test = stratified_split(y, fraction, seed)
    want_train, want_test = train_test_split(np.arange(len(y)), test_size=fraction, random_state=seed, stratify=y)
    assert np.array_equal(train, want_train) and np.array_equal(test, want_test)


def test_a_skewed_label_set_keeps_its_proportions():
    y = np.array([0] * 50 + [1] * 30 + [2] * 7)
    train, test = stratified_split(y, 0.2, 3)
    assert sorted(np.concatenate([train, test]).tolist()) == list(range(len(y)))
    assert len(test) == 18 and np.bincount(y[test]).tolist() in ([10, 6, 2], [10, 7, 1], [11, 6, 1])


def test_loading_the_split_does_not_import_scikit_learn():
    code = ("import sys; from shoal.peer.workloads.digits import load_digits_split; "
            "tr, te = load_digits_split(0); assert (len(tr), len(te)) == (1437, 360); "
            "print(sorted(m for m in ('sklearn', 'scipy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr[-2000:]
    assert len(load_digits_split(0)[1]) == 360
