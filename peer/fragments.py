"""Streaming DiLoCo's fragments: which parameters a round carries, and their outer optimizer.

Streaming DiLoCo (Douillard et al. 2025, "Streaming DiLoCo with overlapping communication",
arXiv 2501.18512) splits the parameters into F fragments and synchronises one fragment per
round, on a staggered schedule: round r carries fragment `r mod F` (`fragment_of`), the rounds
come every H/F inner steps, so each fragment is synchronised every H inner steps, fragment f at
offset (f + 1) H/F. A round's all-reduce moves 1/F of the model instead of all of it: the peak
bandwidth drops by F at the same bytes per inner step.

`Fragments` is the partition, the same on every peer (a pure function of the parameter layout,
F and the mode):

- "strided" (the paper's): the parameters are grouped into layers by name (`layer_of`: the
  name up to its first integer component, `blocks.3.mlp.0.weight` -> `blocks.3`; a name without
  one is its own group, `embed.weight` -> `embed`), and layer group j (in the order of first
  appearance) goes to fragment `j mod F`. Fragments are as balanced as the model's layers are.
- "contiguous": the flat parameter vector cut into F consecutive ranges of `n // F` or
  `n // F + 1` elements (range f starts at `f * n // F`), cutting through tensors where it must:
  exactly balanced whatever the layout (the outer optimizers are elementwise).

`FragmentedOuter` keeps one outer optimizer per fragment (each fragment's momentum and step
count), serialised in the committed state, so the state and its digest are bit-identical on
every peer as before. `eager_gradient`, `merge` and `eager_correct` are the eager outer update
(Kale et al. 2025), which a peer applies to its own working parameters only.
Pure: arrays in, arrays out.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable, Sequence

import numpy as np

from shoal.common.errors import InvalidArgument
from shoal.peer.outer import OuterOptimizer

__all__ = ["FRAGMENT_MODES", "FragmentedOuter", "Fragments", "eager_correct", "eager_gradient", "fragment_of",
           "layer_of", "merge"]

FRAGMENT_MODES = ("contiguous", "strided")
_INDEX = re.compile(r"^\d+$")


def fragment_of(round_: int, fragments: int) -> int:
    """The fragment round `round_` carries on the staggered schedule: `round_ mod fragments`."""
    return int(round_) % max(1, int(fragments))


def eager_gradient(fresh: np.ndarray, share: float, pending: np.ndarray | None = None) -> np.ndarray:
    """The eager outer gradient of one peer (Kale, Douillard, Donchev 2025, "Eager updates for
    overlapped communication and computation in DiLoCo", arXiv 2502.12996): while the round that
    all-reduces the fresh pseudo-gradients is in flight, a peer steps its own copy of the outer
    parameters with its own fresh term at once and the other peers' terms as they arrive:

        eager = share * fresh + pending,   pending = sum over the other peers j of share_j * delta_j(t - 1)

    With M equally weighted peers `share` = 1/M and this is the paper's
    `(1/M) Delta_m(t) + (1/M) sum_{j != m} Delta_j(t - 1)`: in the paper a worker's copy of the
    global parameters receives the others' terms one outer step late, so `pending` is their
    delayed sum. Shoal's committed state applies each round's whole all-reduce when the round
    commits, so the committed parameters a peer steps from already hold every delayed term:
    there `pending` is None (zeros), the eager step adds the peer's own term, and the others'
    fresh terms arrive with the committed round (`eager_correct`). Every term is applied once.

    Args:
        fresh: `(m,)` float32, this peer's pseudo-gradient of the round in flight (committed - local).
        share: this peer's weight in the all-reduce, `n_i / sum n` of the plan, in [0, 1].
        pending: `(m,)` float32, the other peers' weighted terms not yet applied, or None.

    Returns a new `(m,)` float32 array (float64 arithmetic, rounded once).

    Raises:
        InvalidArgument: share outside [0, 1] ("share"), `pending` of another shape ("pending").
    """
    if not 0.0 <= share <= 1.0:
        raise InvalidArgument(f"share: must be in [0, 1], got {share!r}")
    out = float(share) * np.asarray(fresh, np.float64)
    if pending is not None:
        if np.shape(pending) != out.shape:
            raise InvalidArgument(f"pending: shape {np.shape(pending)} != the fresh pseudo-gradient's {out.shape}")
        out = out + np.asarray(pending, np.float64)
    return out.astype(np.float32)


def merge(local: np.ndarray, committed: np.ndarray, alpha: float) -> np.ndarray:
    """Streaming DiLoCo's merge of a fragment (Douillard et al. 2025): `alpha * local + (1 - alpha)
    * committed`, `(m,)` float32 in, a new `(m,)` float32 out (float32 arithmetic). The eager
    update merges its estimate θ_e the same way at the hand-over."""
    a = np.float32(alpha)
    return (a * local + (np.float32(1) - a) * committed).astype(np.float32)


def eager_correct(local: np.ndarray, committed: np.ndarray, estimate: np.ndarray, alpha: float) -> np.ndarray:
    """The eager update's correction when the round lands: the hand-over merged the estimate
    θ_e (`merge(local, estimate, alpha)`), the committed θ_c replaces it and the inner steps
    taken since are kept: `local + (1 - alpha) * (θ_c - θ_e)`. So the working parameters end as
    `alpha * θ_sub + (1 - alpha) * θ_c + (steps since the hand-over)`, exact when θ_e = θ_c.
    `(m,)` float32 in, a new `(m,)` float32 out; alpha = 0 is the whole-model overlap's
    `θ_c + (θ - θ_e)`."""
    return (local + (np.float32(1) - np.float32(alpha)) * (committed - estimate)).astype(np.float32)


def layer_of(name: str) -> str:
    """The layer group of parameter `name`: the dotted name up to its first integer component
    (`blocks.3.qkv.weight` -> `blocks.3`), else its first component (`ln.weight` -> `ln`)."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if _INDEX.match(part):
            return ".".join(parts[:i + 1])
    return parts[0]


class Fragments:
    """A partition of the `(n,)` flat parameter vector into `count` fragments (module docstring).

    Args:
        layout: `(name, shape)` of each parameter in the flat vector's order (the PyTorch
            integration's `layout_of(model)`: `named_parameters()` order); or an int `n` (only
            for "contiguous": the names do not matter).
        count: F >= 1.
        mode: "contiguous" or "strided".

    Attributes:
        indices: per fragment, the sorted int64 positions in the flat vector it holds; together
            they cover `0..n-1` exactly once.
        sizes: elements per fragment.

    Raises:
        InvalidArgument: count < 1 ("fragments"), unknown mode ("fragment_partition"), a
            fragment that would be empty (F above n for contiguous, above the layer groups for
            strided: "fragments"), or a layout without names for "strided" ("layout").
    """

    def __init__(self, layout: Sequence[tuple[str, Sequence[int]]] | int, count: int, mode: str = "contiguous"):
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise InvalidArgument(f"fragments: expected an integer >= 1, got {count!r}")
        if mode not in FRAGMENT_MODES:
            raise InvalidArgument(f"fragment_partition: {mode!r} is not one of {FRAGMENT_MODES}")
        self.count, self.mode = count, mode
        if isinstance(layout, int):
            if mode == "strided":
                raise InvalidArgument("layout: the strided partition needs the parameters' names")
            n, sizes_by_name = layout, None
        else:
            sizes_by_name = [(str(name), int(np.prod(shape)) if len(shape) else 1) for name, shape in layout]
            n = sum(s for _, s in sizes_by_name)
        self.n = int(n)
        if mode == "contiguous":
            cuts = [f * self.n // count for f in range(count + 1)]
            self.indices = tuple(np.arange(cuts[f], cuts[f + 1], dtype=np.int64) for f in range(count))
        else:
            groups: dict[str, list[tuple[int, int]]] = {}
            off = 0
            for name, size in sizes_by_name or ():
                groups.setdefault(layer_of(name), []).append((off, off + size))
                off += size
            if len(groups) < count:
                raise InvalidArgument(f"fragments: {count} strided fragments need at least {count} layer groups, "
                                      f"the model has {len(groups)} ({', '.join(groups)})")
            ranges: list[list[tuple[int, int]]] = [[] for _ in range(count)]
            for j, spans in enumerate(groups.values()):
                ranges[j % count] += spans
            self.indices = tuple(np.sort(np.concatenate([np.arange(a, b, dtype=np.int64) for a, b in r]))
                                 for r in ranges)
        self.sizes = tuple(int(ix.size) for ix in self.indices)
        if min(self.sizes) == 0:
            raise InvalidArgument(f"fragments: {count} fragments of {self.n} parameters leave one empty")

    def take(self, flat: np.ndarray, fragment: int) -> np.ndarray:
        """`flat[indices[fragment]]`: a new `(sizes[fragment],)` array of `flat`'s dtype.

        Raises:
            InvalidArgument: fragment out of range ("fragment") or `flat` not `(n,)` ("params").
        """
        self._check(flat, fragment)
        return flat[self.indices[fragment]]

    def put(self, flat: np.ndarray, fragment: int, values: np.ndarray) -> np.ndarray:
        """A copy of `flat` `(n,)` with fragment `fragment` replaced by `values` `(sizes[fragment],)`.

        Raises:
            InvalidArgument: fragment out of range, `flat` not `(n,)`, or `values` of another size.
        """
        self._check(flat, fragment)
        if values.shape != (self.sizes[fragment],):
            raise InvalidArgument(f"values: shape {values.shape} != fragment {fragment}'s "
                                  f"({self.sizes[fragment]},)")
        out = flat.copy()
        out[self.indices[fragment]] = values
        return out

    def _check(self, flat: np.ndarray, fragment: int) -> None:
        if not 0 <= fragment < self.count:
            raise InvalidArgument(f"fragment: {fragment} outside 0..{self.count - 1}")
        if flat.shape != (self.n,):
            raise InvalidArgument(f"params: shape {flat.shape} != ({self.n},) of the partition")


class FragmentedOuter:
    """One outer optimizer per fragment (`make()` builds each; all the same rule).

    `step_fragment(f, params_f, grad_f)` steps fragment f's optimizer only. `state()` holds every
    fragment's buffers as `"<f>.<buffer>"` and `"<f>.step"`, plus `"step"` (the total count), so
    `CommittedState` serialises and digests it like any outer optimizer's; `load_state` restores
    it. `step` (a whole-vector step) is refused: a fragmented run steps fragments.

    Raises (all methods): InvalidArgument as the wrapped optimizers do, naming the fragment.
    """

    def __init__(self, make: Callable[[], OuterOptimizer], count: int):
        if count < 1:
            raise InvalidArgument(f"fragments: expected >= 1, got {count}")
        self._parts = [make() for _ in range(count)]
        # Its own name: a checkpoint of a run with other fragments is refused by name, not by a key.
        self.name = f"{self._parts[0].name}/fragments={count}"
        self.count = count

    def step_fragment(self, fragment: int, params: np.ndarray, pseudo_grad: np.ndarray) -> np.ndarray:
        """New `(m,)` float32 parameters of fragment `fragment` after its outer step."""
        if not 0 <= fragment < self.count:
            raise InvalidArgument(f"fragment: {fragment} outside 0..{self.count - 1}")
        return self._parts[fragment].step(params, pseudo_grad)

    def preview_fragment(self, fragment: int, params: np.ndarray, pseudo_grad: np.ndarray) -> np.ndarray:
        """What `step_fragment` would return, on a copy of fragment `fragment`'s optimizer: this
        one is unchanged (the eager update's local outer step)."""
        if not 0 <= fragment < self.count:
            raise InvalidArgument(f"fragment: {fragment} outside 0..{self.count - 1}")
        return copy.deepcopy(self._parts[fragment]).step(params, pseudo_grad)

    def step(self, params: np.ndarray, pseudo_grad: np.ndarray) -> np.ndarray:
        raise InvalidArgument("outer: a fragmented run steps one fragment per round (step_fragment)")

    def state(self) -> dict[str, np.ndarray]:
        out: dict[str, np.ndarray] = {}
        total = 0
        for f, part in enumerate(self._parts):
            for k, v in part.state().items():
                out[f"{f}.{k}"] = v
            total += int(out[f"{f}.step"])
        out["step"] = np.array(total, dtype=np.int64)
        return out

    def load_state(self, state: dict[str, np.ndarray]) -> None:
        """Restore from `state()`. Raises InvalidArgument (nothing changed) for a key of no
        fragment, or what a fragment's optimizer refuses."""
        if not isinstance(state, dict):
            raise InvalidArgument("state: expected a dict")
        per: list[dict[str, np.ndarray]] = [{} for _ in self._parts]
        for key, value in state.items():
            if key == "step":
                continue
            head, _, rest = key.partition(".")
            if not (head.isdigit() and int(head) < self.count and rest):
                raise InvalidArgument(f"state: key {key!r} names no fragment of {self.count}")
            per[int(head)][rest] = value
        fresh = []
        for f, part_state in enumerate(per):
            part = copy.deepcopy(self._parts[f])
            try:
                part.load_state(part_state)
            except InvalidArgument as exc:
                raise InvalidArgument(f"state: fragment {f}: {exc}") from None
            fresh.append(part)
        self._parts = fresh
