"""Differential privacy of a run: where the noise goes, and the accountant that says what ε it buys.

Responsible for: the run's DP settings as both sides read them (`DpSettings`), the contributor's
clipping and noise (`clip_and_noise`, what a peer does to its pseudo-gradient before the
all-reduce in the `distributed` and `local` modes), and the privacy accounting over committed
rounds (`PrivacyAccountant`, Rényi DP from Google's `dp-accounting` library). Not responsible for
the owners' noise of the `owner` mode (`shoal.peer.reduction`), nor for deciding when a run stops
(the coordinator's round engine asks `PrivacyAccountant.epsilon_after`).

The mechanism is DP-FedAvg (McMahan et al. 2018, "Learning Differentially Private Recurrent
Language Models"): every contribution (a participant's whole pseudo-gradient) is clipped to L2
norm C (`max_norm`), the round's aggregate is the uniform mean of the p clipped contributions
plus Gaussian noise, and one round is the sampled Gaussian mechanism with noise multiplier σ
(`dp_sigma`) at user level (neighbouring runs differ by one participant's whole data). Modes:

- `owner`: the shard owners add `N(0, (σC/p)²)` to the mean once (central DP at the owners, who
  see every clipped contribution in the clear).
- `distributed`: every participant adds its share `N(0, σ²C²/p)` to its own clipped contribution,
  so the sum carries `N(0, σ²C²)` and the mean the same noise as in `owner`; no party adds the
  whole noise (distributed DP, as under secure aggregation: Kairouz et al. 2021, "The Distributed
  Discrete Gaussian Mechanism"). The guarantee holds for whoever sees only the aggregate (the
  model); a party that sees one contribution sees it with 1/p of the noise.
- `local`: every participant adds `N(0, σ²C²)` to its own clipped contribution (local DP): each
  contribution is private on its own, against every other party, and the mean carries p times the
  variance of the central modes.

Accounting: each committed round is one `GaussianDpEvent(σ)`, Poisson-sampled with probability q
in the central modes (`owner`, `distributed`): q = cohort size / ready pool with cohorts, 1 without
(every ready peer takes part: no amplification). The cohort draw is uniform without replacement of
a fixed size; treating it as Poisson sampling with q = K/N is the standard approximation of
DP-FedAvg and TensorFlow Federated. In `local` mode q is 1 (the receivers of a contribution know
who sent it). ε is the RDP accountant's for δ (`dp_delta`), composition over every committed
round. Aborted attempts are not counted: their partial results reach only participants.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

import numpy as np



def _library():
    """dp_accounting's (dp_event, RdpAccountant), imported on first use (it pulls in scipy: ~2 s
    of CPU that a run without DP, and every peer, must not pay); (None, None) without the
    `privacy` extra (DpSettings.check says what is missing when a run needs it)."""
    try:
        from dp_accounting import dp_event
        from dp_accounting.rdp import RdpAccountant
    except ImportError:  # pragma: no cover - exercised only without the extra
        return None, None
    return dp_event, RdpAccountant

DP_MODES = ("owner", "distributed", "local")
ON_BUDGET = ("stop", "warn")
# Integer Rényi orders: the fractional ones of the library's default converge slowly for q < 1.
RDP_ORDERS = tuple(range(2, 129)) + (256, 512, 1024)


class PrivacyError(ValueError):
    """A DP setting is unusable (the message names the setting)."""


@dataclass(frozen=True)
class DpSettings:
    """The run's differential-privacy settings ([run] dp_*; docs/aggregation.md).

    sigma: noise multiplier σ (0 = no DP). clip: C, the L2 bound of one contribution (max_norm).
    mode: one of DP_MODES. delta: δ of the reported (ε, δ). epsilon_budget: 0 = none; otherwise
    what `on_budget` does once a round would spend more: "stop" the run or "warn" in the log.
    """

    sigma: float = 0.0
    clip: float = 0.0
    mode: str = "owner"
    delta: float = 1e-5
    epsilon_budget: float = 0.0
    on_budget: str = "stop"

    @property
    def enabled(self) -> bool:
        return self.sigma > 0

    @property
    def at_contributor(self) -> bool:
        """The participants clip and add noise themselves (not the owners)."""
        return self.enabled and self.mode in ("distributed", "local")

    def check(self, *, accounting: bool = True) -> None:
        """Raises PrivacyError naming the first unusable setting; with `accounting` (the
        coordinator) also when DP is on and the dp-accounting package is missing."""
        if self.mode not in DP_MODES:
            raise PrivacyError(f"dp_mode: expected one of {', '.join(DP_MODES)}, got {self.mode!r}")
        if self.on_budget not in ON_BUDGET:
            raise PrivacyError(f"dp_on_budget: expected stop or warn, got {self.on_budget!r}")
        if not (math.isfinite(self.sigma) and self.sigma >= 0):
            raise PrivacyError(f"dp_sigma: must be finite and >= 0, got {self.sigma}")
        if self.enabled and not (math.isfinite(self.clip) and self.clip > 0):
            raise PrivacyError("dp_sigma: differential privacy needs a clipping bound (max_norm > 0)")
        if not 0 < self.delta < 1:
            raise PrivacyError(f"dp_delta: must be in (0, 1), got {self.delta}")
        if not (math.isfinite(self.epsilon_budget) and self.epsilon_budget >= 0):
            raise PrivacyError(f"dp_epsilon_budget: must be finite and >= 0, got {self.epsilon_budget}")
        if accounting and self.enabled and _library()[1] is None:
            raise PrivacyError("dp_sigma: privacy accounting needs the dp-accounting package "
                               "(pip install 'shoal[privacy]')")

    def contributor_std(self, participants: int) -> float:
        """Standard deviation of the noise one contributor adds to each element of its clipped
        contribution (before the 1/p weight): σC/√p (`distributed`), σC (`local`), 0 otherwise."""
        if not self.at_contributor:
            return 0.0
        p = max(1, participants)
        return self.sigma * self.clip / math.sqrt(p) if self.mode == "distributed" else self.sigma * self.clip


def clip_l2(x: np.ndarray, clip: float) -> np.ndarray:
    """`x` `(n,)` float32 scaled by min(1, clip / ‖x‖₂) (a new float32 array; the norm in float64).

    A non-finite `x` is returned as is (the collectives and the owners refuse it)."""
    x = np.asarray(x, dtype=np.float32)
    norm = float(np.linalg.norm(x.astype(np.float64)))
    if not math.isfinite(norm) or norm <= clip:
        return x.copy()
    return (x * np.float32(clip / norm)).astype(np.float32)


def clip_and_noise(update: np.ndarray, dp: DpSettings, participants: int,
                   rng: np.random.Generator) -> np.ndarray:
    """A contributor's DP contribution: `update` `(n,)` clipped to L2 norm `dp.clip`, plus
    Gaussian noise of `dp.contributor_std(participants)` per element, as `(n,)` float32 (not yet
    weighted by 1/p). `rng` must be unpredictable to the other parties (fresh OS entropy)."""
    clipped = clip_l2(update, dp.clip)
    std = dp.contributor_std(participants)
    if std <= 0:
        return clipped
    return (clipped + rng.normal(0.0, std, size=clipped.shape)).astype(np.float32)


class PrivacyAccountant:
    """ε spent by a run's committed rounds (module docstring).

    `add_round(q)` records one committed round sampled with probability q (1 = everyone took
    part); `epsilon()` is the RDP accountant's ε at the settings' δ for every round recorded so
    far, and `epsilon_after(q)` what one more round would make it. Raises PrivacyError for a q
    outside (0, 1]. With σ = 0 every ε is 0 (no DP is claimed, nothing is accounted).
    """

    def __init__(self, dp: DpSettings):
        dp.check()
        self.dp = dp
        self.rounds: Counter[float] = Counter()  # sampling rate -> committed rounds at that rate

    @property
    def committed(self) -> int:
        return sum(self.rounds.values())

    def sampling(self, q: float) -> float:
        """The rate the accountant uses for a round sampled at `q`: 1 in local mode."""
        if not 0 < q <= 1:
            raise PrivacyError(f"sampling rate must be in (0, 1], got {q}")
        return 1.0 if self.dp.mode == "local" else float(q)

    def add_round(self, q: float = 1.0) -> None:
        self.rounds[self.sampling(q)] += 1

    def epsilon(self) -> float:
        return self._epsilon(self.rounds)

    def epsilon_after(self, q: float = 1.0) -> float:
        more = Counter(self.rounds)
        more[self.sampling(q)] += 1
        return self._epsilon(more)

    def budget_left(self, q: float = 1.0) -> bool:
        """Whether one more round at `q` keeps ε within the budget (always with no budget)."""
        return not self.dp.epsilon_budget or self.epsilon_after(q) <= self.dp.epsilon_budget

    def _epsilon(self, rounds: Counter[float]) -> float:
        if not self.dp.enabled or not rounds:
            return 0.0
        acc = _library()[1](RDP_ORDERS)
        for q, count in sorted(rounds.items()):
            acc.compose(sampled_gaussian(self.dp.sigma, q), count)
        return float(acc.get_epsilon(self.dp.delta))


def sampled_gaussian(sigma: float, q: float):
    """The dp-accounting event of one round: `GaussianDpEvent(sigma)`, Poisson-sampled at q < 1."""
    dp_event = _library()[0]
    event = dp_event.GaussianDpEvent(sigma)
    return event if q >= 1 else dp_event.PoissonSampledDpEvent(q, event)
