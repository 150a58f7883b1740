"""A small MLP classifier in numpy with a flat parameter vector.

All parameters live in one float32 vector of shape (num_params,), so a pseudo-gradient is one
flat tensor for the all-reduce. The inner optimizer is Adam (Kingma & Ba 2015), run in float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


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
