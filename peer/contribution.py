"""What a peer sends into a round's all-reduce, and what it runs as a shard owner.

The round protocol (peer.rounds) is the same for every workload; what differs is the
*contribution policy*: given this peer's update (the workload's `(n,)` array for the round) and
the plan, it returns the array to all-reduce and the owner-side reduction (peer.reduction, for
the butterfly; None = the plain sum). Two policies:

- `FedAvgContribution` (training peers, docs/aggregation.md): the result must be FedAvg's
  sample-weighted mean of the pseudo-gradients. Butterfly: the unweighted pseudo-gradient, and
  owners run the run's aggregator with the plan's sample counts as weights. Ring (plain sum): the
  pseudo-gradient pre-weighted by n_i / sum n, so the sum is the weighted mean. With
  differential privacy at the contributor (dp_mode distributed or local, shoal.common.privacy)
  the pseudo-gradient is clipped, noised and weighted 1/p instead (DP-FedAvg's uniform mean); the
  noise of a round is drawn once, so a retried attempt sends the same values. Sparse
  collectives ("allgather", "sparse_rs"): the unweighted pseudo-gradient (it feeds the peer's error-feedback accumulator)
  and the weights n_i / sum n, which every peer applies to the decoded contributions; only the
  mean combines with sparse payloads (any other aggregator, max_norm or dp_sigma is refused,
  naming both settings). A secure attempt (the plan carries a secure-aggregation graph seed,
  peer.secure_round) takes the plain-sum form on every collective: the owners only add masked
  rows, so the contribution is pre-weighted (n_i / sum n, or 1/p with contributor DP).
- `SumContribution` (the all-reduce benchmark job, shoal.bench.collective_job): the input as is, so the
  result is the plain SUM of the inputs (what gloo's all_reduce computes); owners run an
  aggregator only when the job names one for the round.

A policy also says which results it may apply (`check`: FedAvg refuses a non-finite aggregate,
the sum accepts what the inputs give). Both may forge what they send (`attack`, testing only:
peer.testing.byzantine). Pure: arrays in, arrays out; no sockets.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from shoal.common.errors import InvalidArgument
from shoal.common.plan import Plan, is_sparse_collective
from shoal.common.privacy import DpSettings, clip_and_noise
from shoal.peer.testing.byzantine import ATTACKS, forge
from shoal.peer.collectives import CollectiveError
from shoal.peer.reduction import OwnerReduction, ReductionSpec


@dataclass(frozen=True)
class Prepared:
    """values: `(n,)` array to all-reduce (float32 for training; the job keeps its dtype).
    reducer: the shard-owner reduction (butterfly only), or None for the plain sum.
    weights: the sparse collectives only ("allgather", "sparse_rs" plans): per participant (plan order), the
    factor of its decoded contribution in the sum (FedAvg: n_i / sum n); None = the plain sum."""

    values: np.ndarray
    reducer: OwnerReduction | None
    weights: tuple[float, ...] | None = None


def _sparse_refusal(aggregator: str, plan: Plan) -> InvalidArgument:
    return InvalidArgument(f"aggregator: {aggregator} does not combine with compression = {plan.compression} "
                           "(sparse payloads are summed, weighted, by every peer: use aggregator = mean)")


class Contribution(Protocol):
    """A contribution policy (see the module docstring)."""

    def prepare(self, update: np.ndarray, plan: Plan, me: str) -> Prepared:
        """What `me` sends for `update` `(n,)` in `plan`. Raises InvalidArgument for a plan whose
        aggregation settings are unusable (the round protocol votes "failed" with the reason)."""
        ...

    def check(self, aggregate: np.ndarray) -> None:
        """Refuse an all-reduce result this policy must never apply: raises CollectiveError (the
        round protocol votes "failed"); returns None when it is acceptable."""
        ...


@dataclass
class Forgery:
    """Testing only: replace the honest update by a forged one (peer.testing.byzantine.forge).
    attack: one of ATTACKS, or "" (honest). scale: None = the attack's default."""

    attack: str = ""
    scale: float | None = None
    rng: np.random.Generator = dataclasses.field(default_factory=np.random.default_rng)

    def __call__(self, x: np.ndarray) -> np.ndarray:
        if self.attack not in ATTACKS:
            return x
        return forge(self.attack, x, self.rng, self.scale)


@dataclass
class FedAvgContribution:
    """Training peers: FedAvg's weighted mean (module docstring). `spec()` gives the run's
    reduction settings (RunConfig.reduction_spec); the plan's `aggregator`, when set, overrides
    the spec's aggregator (with default parameters). `dp()` gives the run's DP settings (None or
    noise at the owners: no contributor noise); `rng` draws that noise (fresh OS entropy)."""

    spec: Callable[[], ReductionSpec]
    forgery: Forgery = dataclasses.field(default_factory=Forgery)
    dp: Callable[[], DpSettings] | None = None
    rng: np.random.Generator = dataclasses.field(default_factory=np.random.default_rng)
    _noised: tuple[int, int, np.ndarray] | None = dataclasses.field(default=None, repr=False)

    def prepare(self, update: np.ndarray, plan: Plan, me: str) -> Prepared:
        grad = self.forgery(update.astype(np.float32))
        dp = self.dp() if self.dp is not None else None
        if is_sparse_collective(plan):
            # Sparse payloads: the raw pseudo-gradient feeds this peer's error-feedback
            # accumulator; every peer weights the decoded contributions by their sample counts.
            spec = self.spec()
            aggregator = plan.aggregator or spec.aggregator
            private = spec.dp_sigma > 0 or (dp is not None and dp.at_contributor)
            if aggregator != "mean" or spec.max_norm > 0 or private:
                raise _sparse_refusal(aggregator if aggregator != "mean" else
                                      ("max_norm" if spec.max_norm > 0 else "dp_sigma"), plan)
            counts = [n or 1 for n in plan.num_samples] or [1] * plan.size
            total = float(sum(counts))
            return Prepared(grad, None, tuple(c / total for c in counts))
        if dp is not None and dp.at_contributor:
            return self._private(grad, dp, plan)
        if plan.collective == "butterfly" and not plan.secagg_seed:
            spec = self.spec()
            if plan.aggregator and plan.aggregator != spec.aggregator:
                spec = dataclasses.replace(spec, aggregator=plan.aggregator, params={})
            weights = np.array([n or 1 for n in plan.num_samples], dtype=np.float64)
            return Prepared(grad, OwnerReduction(spec, weights, grad.size))
        total = sum(plan.num_samples) or plan.size
        mine = plan.num_samples[plan.position(me)] or 1
        return Prepared((grad * np.float32(mine / total)).astype(np.float32), None)

    def _private(self, grad: np.ndarray, dp: DpSettings, plan: Plan) -> Prepared:
        """Clipped, noised (once per round: retries reuse it) and weighted 1/p; on the butterfly
        the owners take the uniform mean (sum of what they get, weights all 1, no bound)."""
        cached = self._noised
        if cached is None or cached[0] != plan.round or cached[2].shape != grad.shape or cached[1] < plan.size:
            self._noised = (plan.round, plan.size, clip_and_noise(grad, dp, plan.size, self.rng))
        elif cached[1] > plan.size:
            # A retry with fewer survivors: top the same noise up to this size's share, so the
            # sum still carries the whole noise and no attempt's values are drawn afresh.
            more = dp.contributor_std(plan.size) ** 2 - dp.contributor_std(cached[1]) ** 2
            top = cached[2] + self.rng.normal(0.0, math.sqrt(max(0.0, more)), size=cached[2].shape)
            self._noised = (plan.round, plan.size, top.astype(np.float32))
        noisy = self._noised[2]
        if plan.collective == "butterfly" and not plan.secagg_seed:
            spec = dataclasses.replace(self.spec(), aggregator="mean", params={}, max_norm=0.0, dp_sigma=0.0)
            return Prepared(noisy, OwnerReduction(spec, np.ones(plan.size), noisy.size))
        return Prepared((noisy * np.float32(1.0 / plan.size)).astype(np.float32), None)

    def check(self, aggregate: np.ndarray) -> None:
        """A model update must be finite (the collectives already refuse non-finite chunks from
        honest-looking peers; this is the last line before the outer step)."""
        if not np.isfinite(aggregate).all():
            raise CollectiveError("the aggregate holds non-finite values")


@dataclass
class SumContribution:
    """The benchmark job: the plain sum of the inputs (module docstring). `aggregators`: owner
    aggregators by round (round r uses entry r mod len); empty = the sum everywhere."""

    aggregators: Sequence[str] = ()
    forgery: Forgery = dataclasses.field(default_factory=Forgery)

    def prepare(self, update: np.ndarray, plan: Plan, me: str) -> Prepared:
        values = self.forgery(update)
        if is_sparse_collective(plan):
            if self.aggregators:
                raise _sparse_refusal(self.aggregator(plan.round), plan)
            return Prepared(values, None)
        if not self.aggregators:
            return Prepared(values, None)
        spec = ReductionSpec(self.aggregators[plan.round % len(self.aggregators)])
        return Prepared(values, OwnerReduction(spec, np.ones(plan.size), values.size))

    def check(self, aggregate: np.ndarray) -> None:
        """Any sum is acceptable: like gloo's all_reduce, a NaN input gives a NaN sum."""

    def aggregator(self, round_: int) -> str:
        """The name of what owners compute in `round_` ("sum" without aggregators)."""
        return self.aggregators[round_ % len(self.aggregators)] if self.aggregators else "sum"
