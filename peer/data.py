"""The default workload's data: UCI handwritten digits (8x8 images, 10 classes).

The data set ships inside scikit-learn (`sklearn.datasets.load_digits`), so nothing is
downloaded. A fixed, seeded 80/20 split gives the training pool and the held-out test set; the
training pool is partitioned across peers, IID or with label skew (non-IID).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

NUM_FEATURES = 64
NUM_CLASSES = 10


@dataclass(frozen=True)
class Dataset:
    """Features `x` (N, 64) float32 scaled to [0, 1]; labels `y` (N,) int64 in [0, 10)."""

    x: np.ndarray
    y: np.ndarray

    def __len__(self) -> int:
        return int(self.y.shape[0])


def load_digits_split(seed: int = 0, test_fraction: float = 0.2) -> tuple[Dataset, Dataset]:
    """Return (train, test): a stratified, seeded split of the 1,797 digits images."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    bunch = load_digits()
    x = (bunch.data / 16.0).astype(np.float32)
    y = bunch.target.astype(np.int64)
    x_tr, x_te, y_tr, y_te = train_test_split(
        x, y, test_size=test_fraction, random_state=seed, stratify=y
    )
    return Dataset(x_tr, y_tr), Dataset(x_te, y_te)


def partition(train: Dataset, num_shards: int, shard: int, *, non_iid: bool = False, seed: int = 0) -> Dataset:
    """The `shard`-th of `num_shards` disjoint parts of `train`.

    IID: a seeded random permutation cut into equal parts. Non-IID (label skew): samples sorted
    by label and cut into 2*num_shards contiguous blocks, two blocks per shard (the "pathological
    non-IID" split of McMahan et al. 2017), so each peer sees few classes.

    Raises:
        ValueError: `shard` is not in [0, num_shards).
    """
    if not 0 <= shard < num_shards:
        raise ValueError(f"shard: {shard} not in [0, {num_shards})")
    rng = np.random.default_rng(seed)
    n = len(train)
    if not non_iid:
        idx = np.array_split(rng.permutation(n), num_shards)[shard]
    else:
        order = np.argsort(train.y, kind="stable")
        blocks = np.array_split(order, 2 * num_shards)
        pick = rng.permutation(2 * num_shards).reshape(num_shards, 2)[shard]
        idx = np.concatenate([blocks[b] for b in pick])
    idx = np.sort(idx)
    return Dataset(train.x[idx], train.y[idx])
