"""The default workload: a small numpy MLP classifier on the UCI handwritten digits.

Data: 8x8 images, 10 classes, shipped inside scikit-learn (its `digits.csv.gz`, read directly), so
nothing is downloaded. A fixed, seeded 80/20 split gives the training pool and the held-out test
set; the training pool is partitioned across peers, IID or with label skew (non-IID).

Model: all parameters live in one float32 vector of shape (num_params,), so a pseudo-gradient is
one flat tensor for the all-reduce. The inner optimizer is Adam (Kingma & Ba 2015), run in float32.

`DigitsWorkload` is what a peer trains by default (a `shoal.peer.workloads.base.Workload`);
`baseline_accuracy` trains the same model in one process, the swarm's comparison.
"""

from __future__ import annotations

import gzip
import importlib.util
import math
import pathlib
import time
from dataclasses import dataclass

import numpy as np

from shoal.peer.outer import fedprox_grad
from shoal.common.errors import InvalidArgument
from shoal.peer.training import CommittedState, FlatStateWorkload, LocalUpdate, RunConfig, make_outer_for

NUM_FEATURES = 64
NUM_CLASSES = 10


@dataclass(frozen=True)
class Dataset:
    """Features `x` (N, 64) float32 scaled to [0, 1]; labels `y` (N,) int64 in [0, 10)."""

    x: np.ndarray
    y: np.ndarray

    def __len__(self) -> int:
        return int(self.y.shape[0])


def _digits_file() -> pathlib.Path | None:
    """scikit-learn's copy of the UCI digits (`datasets/data/digits.csv.gz`), found without
    importing scikit-learn (whose import costs ~2 s of CPU, paid by every peer at start)."""
    spec = importlib.util.find_spec("sklearn")
    for root in (spec.submodule_search_locations or []) if spec is not None else []:
        path = pathlib.Path(root) / "datasets" / "data" / "digits.csv.gz"
        if path.is_file():
            return path
    return None


def load_digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """The 1,797 digits images: features (1797, 64) float64 in [0, 16], labels (1797,) int64.
    Read from scikit-learn's data file; `sklearn.datasets.load_digits` where the file is not found."""
    path = _digits_file()
    if path is None:
        from sklearn.datasets import load_digits

        bunch = load_digits()
        return bunch.data, bunch.target.astype(np.int64)
    with gzip.open(path, "rt") as f:
        table = np.loadtxt(f, delimiter=",")
    return table[:, :-1], table[:, -1].astype(np.int64)


def _apportion(counts: np.ndarray, draws: int, rng: np.random.RandomState) -> np.ndarray:
    """`draws` split over classes of sizes `counts` in proportion, floored, the remainder going
    to the largest fractional parts (ties broken by `rng`)."""
    exact = counts / counts.sum() * draws
    out = np.floor(exact)
    short = int(draws - out.sum())
    rest = exact - out
    for value in np.sort(np.unique(rest))[::-1]:
        if short <= 0:
            break
        (tied,) = np.where(rest == value)
        take = min(len(tied), short)
        out[rng.choice(tied, size=take, replace=False)] += 1
        short -= take
    return out.astype(int)


def stratified_split(y: np.ndarray, test_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train indices, test indices) of labels `y` (N,) with class proportions kept: ceil(test_fraction
    x N) test samples. The same draw as scikit-learn's `train_test_split(..., stratify=y,
    random_state=seed)` (its StratifiedShuffleSplit, legacy `RandomState` stream; a unit test
    compares the two), without importing scikit-learn. Deterministic for a given `seed`."""
    n_test = math.ceil(test_fraction * len(y))
    _, inverse, counts = np.unique(y, return_inverse=True, return_counts=True)
    by_class = np.split(np.argsort(inverse, kind="stable"), np.cumsum(counts)[:-1])
    rng = np.random.RandomState(seed)
    n_train = _apportion(counts, len(y) - n_test, rng)
    n_tested = _apportion(counts - n_train, n_test, rng)
    train, test = [], []
    for members, k_train, k_test in zip(by_class, n_train, n_tested):
        shuffled = members[rng.permutation(len(members))]
        train.extend(shuffled[:k_train])
        test.extend(shuffled[k_train:k_train + k_test])
    return rng.permutation(train), rng.permutation(test)


def load_digits_split(seed: int = 0, test_fraction: float = 0.2) -> tuple[Dataset, Dataset]:
    """Return (train, test): a stratified, seeded split (`stratified_split`) of the 1,797 digits
    images; features scaled to [0, 1] float32."""
    data, target = load_digits_arrays()
    x = (data / 16.0).astype(np.float32)
    tr, te = stratified_split(target, test_fraction, seed)
    return Dataset(x[tr], target[tr]), Dataset(x[te], target[te])


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


@dataclass(frozen=True)
class MLPShape:
    """Layer widths, e.g. (64, 64, 10): input, hidden..., classes."""

    widths: tuple[int, ...]

    @property
    def num_params(self) -> int:
        return sum(a * b + b for a, b in zip(self.widths[:-1], self.widths[1:]))

    def views(self, flat: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
        """(weight (a, b), bias (b,)) views into `flat` for each layer (no copies)."""
        out, off = [], 0
        for a, b in zip(self.widths[:-1], self.widths[1:]):
            w = flat[off : off + a * b].reshape(a, b)
            off += a * b
            out.append((w, flat[off : off + b]))
            off += b
        return out


def init_params(shape: MLPShape, seed: int) -> np.ndarray:
    """He-initialised parameters, (num_params,) float32, identical for the same seed."""
    rng = np.random.default_rng(seed)
    flat = np.zeros(shape.num_params, dtype=np.float32)
    for w, _ in shape.views(flat):
        w[...] = rng.standard_normal(w.shape).astype(np.float32) * np.float32(np.sqrt(2.0 / w.shape[0]))
    return flat


def loss_and_grad(shape: MLPShape, flat: np.ndarray, x: np.ndarray, y: np.ndarray) -> tuple[float, np.ndarray]:
    """Mean softmax cross-entropy of a batch and its gradient, (num_params,) float32."""
    layers = shape.views(flat)
    acts = [x]
    h = x
    for i, (w, b) in enumerate(layers):
        h = h @ w + b
        if i < len(layers) - 1:
            h = np.maximum(h, 0.0)
        acts.append(h)
    logits = acts[-1]
    logits = logits - logits.max(axis=1, keepdims=True)
    p = np.exp(logits)
    p /= p.sum(axis=1, keepdims=True)
    n = x.shape[0]
    loss = float(-np.log(p[np.arange(n), y] + 1e-12).mean())
    grad = np.zeros_like(flat)
    gviews = shape.views(grad)
    d = p
    d[np.arange(n), y] -= 1.0
    d /= n
    for i in range(len(layers) - 1, -1, -1):
        gw, gb = gviews[i]
        gw[...] = acts[i].T @ d
        gb[...] = d.sum(axis=0)
        if i > 0:
            d = (d @ layers[i][0].T) * (acts[i] > 0)
    return loss, grad


def predict(shape: MLPShape, flat: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Predicted class per row of `x` (N, 64) -> (N,) int64."""
    h = x
    layers = shape.views(flat)
    for i, (w, b) in enumerate(layers):
        h = h @ w + b
        if i < len(layers) - 1:
            h = np.maximum(h, 0.0)
    return h.argmax(axis=1)


class Adam:
    """Adam (Kingma & Ba 2015) over a flat float32 vector; `step` updates `params` in place."""

    def __init__(self, num_params: int, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8):
        self.lr, self.b1, self.b2, self.eps = lr, betas[0], betas[1], eps
        self.m = np.zeros(num_params, dtype=np.float32)
        self.v = np.zeros(num_params, dtype=np.float32)
        self.t = 0

    def step(self, params: np.ndarray, grad: np.ndarray) -> None:
        self.t += 1
        self.m = self.b1 * self.m + (1 - self.b1) * grad
        self.v = self.b2 * self.v + (1 - self.b2) * grad * grad
        mhat = self.m / (1 - self.b1**self.t)
        vhat = self.v / (1 - self.b2**self.t)
        params -= (self.lr * mhat / (np.sqrt(vhat) + self.eps)).astype(np.float32)


class DigitsWorkload(FlatStateWorkload):
    """The default workload (a peer.workloads.base.Workload): an MLP on one part of the UCI digits
    training set."""

    def __init__(self, cfg: RunConfig, data_shard: int):
        if cfg.fragments > 1:
            raise InvalidArgument("fragments: the digits workload synchronises the whole model every round "
                                  "(streaming needs the PyTorch integration)")
        self.cfg = cfg
        self.shape = MLPShape((NUM_FEATURES, cfg.hidden, NUM_CLASSES))
        train, self.test = load_digits_split(cfg.seed)
        self.data: Dataset = partition(train, cfg.num_data_shards, data_shard % cfg.num_data_shards, non_iid=cfg.non_iid, seed=cfg.seed)
        self.state = CommittedState(init_params(self.shape, cfg.seed), make_outer_for(cfg), 0)
        self.inner = Adam(self.shape.num_params, lr=cfg.lr)
        self.rng = np.random.default_rng(cfg.seed * 1000 + 17 + data_shard)

    @property
    def num_samples(self) -> int:
        return len(self.data)

    def local_state(self) -> dict[str, np.ndarray]:
        """This peer's own state beyond the committed one (its inner Adam), for a checkpoint."""
        return {"inner.m": self.inner.m, "inner.v": self.inner.v, "inner.t": np.array([self.inner.t], np.int64)}

    def load_local_state(self, arrays: dict[str, np.ndarray]) -> None:
        """Inverse of `local_state` (a resume from a checkpoint); arrays of another size are ignored."""
        m, v, t = arrays.get("inner.m"), arrays.get("inner.v"), arrays.get("inner.t")
        if m is not None and v is not None and t is not None and m.shape == self.inner.m.shape == v.shape:
            self.inner.m, self.inner.v, self.inner.t = m.astype(np.float32), v.astype(np.float32), int(t[0])

    def local_update(self) -> LocalUpdate:
        """Run `inner_steps` local steps from the committed parameters; returns the pseudo-gradient."""
        t0 = time.monotonic()
        start = self.state.params
        w = start.copy()
        losses = []
        for _ in range(self.cfg.inner_steps):
            b = self.rng.integers(0, len(self.data), self.cfg.batch_size)
            loss, g = loss_and_grad(self.shape, w, self.data.x[b], self.data.y[b])
            if self.cfg.fedprox_mu > 0:
                g = g + fedprox_grad(w, start, self.cfg.fedprox_mu)
            self.inner.step(w, g)
            losses.append(loss)
        return LocalUpdate((start - w).astype(np.float32), float(np.mean(losses)), len(self.data),
                           self.cfg.inner_steps, time.monotonic() - t0)

    def evaluate(self) -> float:
        """Held-out accuracy of the committed parameters, in [0, 1]."""
        return float((predict(self.shape, self.state.params, self.test.x) == self.test.y).mean())


def baseline_accuracy(cfg: RunConfig, total_steps: int, *, seconds: float | None = None) -> float | None:
    """Single-process baseline: the same MLP and inner optimizer on the whole training set for
    `total_steps` steps (the swarm's total optimizer steps). With `seconds`, None when the steps
    did not fit in that time (it stops there)."""
    end = time.monotonic() + seconds if seconds is not None else math.inf
    shape = MLPShape((NUM_FEATURES, cfg.hidden, NUM_CLASSES))
    train, test = load_digits_split(cfg.seed)
    w = init_params(shape, cfg.seed)
    opt = Adam(shape.num_params, lr=cfg.lr)
    rng = np.random.default_rng(cfg.seed + 99)
    for step in range(total_steps):
        if step % 64 == 0 and time.monotonic() > end:
            return None
        b = rng.integers(0, len(train), cfg.batch_size)
        _, g = loss_and_grad(shape, w, train.x[b], train.y[b])
        opt.step(w, g)
    return float((predict(shape, w, test.x) == test.y).mean())
