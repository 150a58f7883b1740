"""The language-model workload: a byte-level decoder-only transformer on the Python standard library.

Corpus: the `.py` files under `sysconfig.get_paths()["stdlib"]` (every machine with Python has
them, no download), sorted by path, without test folders and installed packages
(`SKIP_DIRS`). The split is by file and fixed: every `VAL_EVERY`-th file (index 9, 19, ... of
the sorted list) is held out for validation, the others are concatenated (separated by a NUL
byte) into the training bytes. A peer's data shard is the `i`-th of `n` contiguous slices of the
training bytes. The corpus is therefore the same on every machine with the same Python version;
a swarm whose peers run different Python versions trains on slightly different data (harmless),
but compares validation losses only within one machine's split.

Model (`TinyGPT`, `LMShape`): byte embedding + learned positions, pre-LayerNorm blocks
(causal multi-head self-attention, GELU MLP 4x), final LayerNorm, output tied to the embedding.
The default shape (d 128, 2 layers, 4 heads, context 64) has 0.43 M parameters: 4 peers run
a few inner steps a second each on 2 shared CPU cores.

Loss: mean cross-entropy per byte, in nats (`val_bits_per_byte = val_loss / ln 2`).
`validation_windows` is a fixed sample of held-out windows (seeded), the same for every peer
and for the synchronous baseline, so their `val_loss` figures are comparable.

Requires PyTorch (`pip install shoal[torch]`).
"""

from __future__ import annotations

import math
import pathlib
import sysconfig
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"})
VAL_EVERY = 10
SEPARATOR = 0  # NUL between files: never inside a source file, marks a document boundary
VOCAB = 256


@dataclass(frozen=True)
class LMShape:
    """d_model, layers, heads, context (bytes). Parameters ~ 12 d^2 layers + (256 + context) d."""

    d_model: int = 128
    layers: int = 2
    heads: int = 4
    context: int = 64

    def __post_init__(self) -> None:
        if min(self.d_model, self.layers, self.heads, self.context) < 1 or self.d_model % self.heads:
            raise ValueError(f"LMShape: positive sizes, d_model divisible by heads: {self}")


@dataclass(frozen=True)
class Corpus:
    """train: (N,) uint8, the training files concatenated; val: (M,) uint8, the held-out files;
    files_train / files_val: how many files each holds."""

    train: np.ndarray
    val: np.ndarray
    files_train: int
    files_val: int

    def shard(self, i: int, n: int) -> np.ndarray:
        """Data shard i of n: a contiguous slice of the training bytes (a view)."""
        if not 0 <= i < n:
            raise ValueError(f"data shard {i} of {n}")
        size = len(self.train) // n
        return self.train[i * size:(i + 1) * size]


def stdlib_files(root: str | None = None) -> list[pathlib.Path]:
    """The corpus files: `.py` under the stdlib folder (or `root`), sorted by path, SKIP_DIRS left out."""
    base = pathlib.Path(root or sysconfig.get_paths()["stdlib"])
    return sorted(p for p in base.rglob("*.py") if not (set(p.relative_to(base).parts[:-1]) & SKIP_DIRS))


@lru_cache(maxsize=2)
def load_corpus(root: str | None = None) -> Corpus:
    """Read and split the corpus (about 12 MB for CPython 3.11, about a second). Raises
    FileNotFoundError when the folder holds no .py file."""
    files = stdlib_files(root)
    if not files:
        raise FileNotFoundError(f"no .py files under {root or sysconfig.get_paths()['stdlib']}")
    sep = bytes([SEPARATOR])
    train, val = [], []
    for k, path in enumerate(files):
        (val if k % VAL_EVERY == VAL_EVERY - 1 else train).append(path.read_bytes() + sep)
    return Corpus(np.frombuffer(b"".join(train), np.uint8), np.frombuffer(b"".join(val), np.uint8),
                  len(train), len(val))


def sample_batch(data: np.ndarray, batch: int, context: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """`batch` random windows of `data`: inputs (batch, context) int64 and targets shifted by one byte."""
    starts = torch.randint(0, len(data) - context - 1, (batch,), generator=gen).numpy()
    idx = starts[:, None] + np.arange(context + 1)[None, :]
    chunk = torch.from_numpy(data[idx].astype(np.int64))
    return chunk[:, :-1], chunk[:, 1:]


def validation_windows(corpus: Corpus, context: int, count: int = 256, seed: int = 1234) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed sample of `count` held-out windows (inputs, targets), the same for a given seed."""
    return sample_batch(corpus.val, count, context, torch.Generator().manual_seed(seed))


class Block(nn.Module):
    def __init__(self, shape: LMShape):
        super().__init__()
        d = shape.d_model
        self.heads = shape.heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """Byte-level decoder-only transformer: forward(idx (B, T) int64, T <= context) -> logits (B, T, 256)."""

    def __init__(self, shape: LMShape = LMShape()):
        super().__init__()
        self.shape = shape
        self.embed = nn.Embedding(VOCAB, shape.d_model)
        self.pos = nn.Parameter(torch.zeros(shape.context, shape.d_model))
        self.blocks = nn.ModuleList(Block(shape) for _ in range(shape.layers))
        self.ln = nn.LayerNorm(shape.d_model)
        self.apply(self._init)
        nn.init.normal_(self.pos, std=0.02)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx) + self.pos[: idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.ln(x) @ self.embed.weight.T

    def loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy per byte (nats), a scalar tensor."""
        return F.cross_entropy(self(inputs).reshape(-1, VOCAB), targets.reshape(-1))


def make_model(shape: LMShape, seed: int) -> TinyGPT:
    """The model every peer (and the baseline) starts from: the same parameters for the same seed."""
    torch.manual_seed(seed)
    return TinyGPT(shape)


def num_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@torch.no_grad()
def evaluate_loss(model: TinyGPT, windows: tuple[torch.Tensor, torch.Tensor], chunk: int = 64) -> float:
    """Mean cross-entropy per byte (nats) of `model` on `windows` (validation_windows), in eval mode."""
    inputs, targets = windows
    total = 0.0
    for s in range(0, len(inputs), chunk):
        total += float(model.loss(inputs[s:s + chunk], targets[s:s + chunk])) * len(inputs[s:s + chunk])
    return total / len(inputs)


def bits_per_byte(loss_nats: float) -> float:
    return loss_nats / math.log(2)
