"""Differential privacy: the contributor's clipping and noise, the accountant against the
dp-accounting library computed directly, the engine's ε per commit and its budget, the settings."""

from __future__ import annotations

import dataclasses

import math

import numpy as np
import pytest

dp_accounting = pytest.importorskip("dp_accounting", reason="the privacy extra (dp-accounting) is not installed")
from dp_accounting import dp_event  # noqa: E402
from dp_accounting.rdp import RdpAccountant  # noqa: E402

from kits.engine import admit, engine  # noqa: E402
from kits.service import service as coordinator_service  # noqa: E402
from shoal.cli.status import render_table  # noqa: E402
from shoal.common.metrics import CoordinatorMetrics  # noqa: E402
from shoal.common.plan import Plan  # noqa: E402
from shoal.common.privacy import (  # noqa: E402
    RDP_ORDERS, DpSettings, PrivacyAccountant, PrivacyError, clip_and_noise, clip_l2,
)
from shoal.config import ConfigError, RunSection  # noqa: E402
from shoal.coordinator.rounds import (  # noqa: E402
    EngineConfig, ReadyInfo, RoundEngine, SendCommit, SendFinished, SendPlan,
)
from shoal.peer.contribution import FedAvgContribution  # noqa: E402
from shoal.peer.training import RunConfig  # noqa: E402
from shoal.v1 import shoal_pb2 as pb  # noqa: E402


def library_epsilon(sigma: float, q: float, rounds: int, delta: float) -> float:
    """What dp-accounting says for `rounds` Poisson-sampled Gaussian rounds, without Shoal."""
    acc = RdpAccountant(RDP_ORDERS)
    event = dp_event.GaussianDpEvent(sigma)
    acc.compose(event if q == 1 else dp_event.PoissonSampledDpEvent(q, event), rounds)
    return acc.get_epsilon(delta)


def test_clip_l2_bounds_the_norm_and_keeps_short_vectors():
    x = np.full(100, 1.0, dtype=np.float32)  # norm 10
    c = clip_l2(x, 2.0)
    assert c.dtype == np.float32 and np.linalg.norm(c) == pytest.approx(2.0, rel=1e-6)
    assert np.allclose(c / c[0], 1.0)  # direction kept
    short = np.full(4, 0.1, dtype=np.float32)
    assert np.array_equal(clip_l2(short, 2.0), short)


@pytest.mark.parametrize("mode,std", [("distributed", 3.0 / math.sqrt(9)), ("local", 3.0)])
def test_contributor_noise_has_the_mode_s_standard_deviation(mode, std):
    dp = DpSettings(sigma=1.5, clip=2.0, mode=mode)
    assert dp.contributor_std(9) == pytest.approx(std)
    noisy = clip_and_noise(np.zeros(200_000, dtype=np.float32), dp, 9, np.random.default_rng(1))
    assert noisy.dtype == np.float32
    assert noisy.std() == pytest.approx(std, rel=0.01) and abs(noisy.mean()) < 0.02


def test_distributed_shares_sum_to_the_central_noise():
    """p participants' shares sum to N(0, (σC)²): the mean carries the owner mode's (σC/p)²."""
    dp = DpSettings(sigma=0.8, clip=1.5, mode="distributed")
    p, n = 6, 100_000
    rng = np.random.default_rng(2)
    total = sum(clip_and_noise(np.zeros(n, np.float32), dp, p, rng).astype(np.float64) for _ in range(p))
    assert (total / p).std() == pytest.approx(0.8 * 1.5 / p, rel=0.02)


def test_owner_mode_adds_nothing_at_the_contributor():
    dp = DpSettings(sigma=1.0, clip=1.0, mode="owner")
    assert not dp.at_contributor and dp.contributor_std(4) == 0.0


@pytest.mark.parametrize("sigma,q,rounds,delta", [(1.0, 1.0, 20, 1e-5), (0.7, 0.1, 50, 1e-6), (2.0, 0.5, 7, 1e-5)])
def test_reported_epsilon_equals_the_library_s_for_the_same_parameters(sigma, q, rounds, delta):
    acc = PrivacyAccountant(DpSettings(sigma=sigma, clip=1.0, mode="distributed", delta=delta))
    for _ in range(rounds):
        acc.add_round(q)
    assert acc.epsilon() == library_epsilon(sigma, q, rounds, delta)
    assert acc.epsilon_after(q) == library_epsilon(sigma, q, rounds + 1, delta)


def test_local_mode_is_accounted_without_sampling_amplification():
    acc = PrivacyAccountant(DpSettings(sigma=1.0, clip=1.0, mode="local"))
    for _ in range(5):
        acc.add_round(0.1)
    assert acc.epsilon() == library_epsilon(1.0, 1.0, 5, 1e-5)


def test_no_noise_accounts_nothing_and_bad_rates_are_refused():
    acc = PrivacyAccountant(DpSettings())
    acc.add_round(1.0)
    assert acc.epsilon() == 0.0
    with pytest.raises(PrivacyError, match="sampling rate"):
        acc.add_round(0.0)
    with pytest.raises(PrivacyError, match="max_norm"):
        DpSettings(sigma=1.0).check()
    with pytest.raises(PrivacyError, match="dp_delta"):
        DpSettings(sigma=1.0, clip=1.0, delta=1.0).check()


def play_round(e, peers, now, digest):
    acts = []
    for p in peers:
        acts += e.ready(p, e.committed_rounds, ReadyInfo(10, 1, 1, e.last_state_digest, e.committed_rounds, now), now)
    acts += e.tick(now)
    plans = [a for a in acts if isinstance(a, SendPlan)]
    if not plans:
        return acts
    plan = plans[0].plan
    for p in plan.participants:
        acts += e.vote(p, plan.round, plan.attempt, True, b"r" + digest, digest, now + 0.1)
    return acts


def test_engine_reports_epsilon_after_every_commit_and_stops_at_the_budget():
    dp = DpSettings(sigma=1.0, clip=1.0, mode="distributed", epsilon_budget=library_epsilon(1.0, 1.0, 3, 1e-5) + 1e-9)
    e = admit(engine(privacy=dp), ["a", "b"])
    eps = []
    for r in range(5):
        acts = play_round(e, ["a", "b"], 1.0 + r, bytes([r + 1]))
        eps += [a.epsilon for a in acts if isinstance(a, SendCommit)]
        if any(isinstance(a, SendFinished) for a in acts):
            break
    assert eps == [library_epsilon(1.0, 1.0, k, 1e-5) for k in (1, 2, 3)]
    assert e.committed_rounds == 3 and e.epsilon == eps[-1]  # a 4th round would exceed the budget
    assert e.finished and "privacy budget spent" in e.waiting(10.0).message


def test_a_coordinator_resumed_with_its_budget_spent_finishes_at_once():
    """Resumed with 3 committed rounds and a budget of 3: the run is over, so the members that
    join (and never get ready: nobody holds the committed state) are told so, not left waiting."""
    dp = DpSettings(sigma=1.0, clip=1.0, mode="distributed", epsilon_budget=library_epsilon(1.0, 1.0, 3, 1e-5) + 1e-9)
    e = admit(engine(privacy=dp), ["a", "b"])
    for r in range(3):
        play_round(e, ["a", "b"], 1.0 + r, bytes([r + 1]))
    again = RoundEngine(dataclasses.replace(e.config), committed=list(e.commits))
    admit(again, ["a", "b"], now=10.0)
    assert any(isinstance(a, SendFinished) for a in again.tick(10.5)) and again.finished


def test_engine_with_warn_goes_on_past_the_budget():
    dp = DpSettings(sigma=1.0, clip=1.0, mode="distributed", epsilon_budget=0.5, on_budget="warn")
    e = admit(engine(privacy=dp, rounds=3), ["a", "b"])
    for r in range(3):
        play_round(e, ["a", "b"], 1.0 + r, bytes([r + 1]))
    assert e.committed_rounds == 3 and e.epsilon == library_epsilon(1.0, 1.0, 3, 1e-5)


def test_engine_samples_at_cohort_over_pool():
    dp = DpSettings(sigma=1.0, clip=1.0, mode="distributed")
    peers = ["a", "b", "c", "d"]
    e = admit(engine(privacy=dp, cohort_size=2, lease_seconds=1e6), peers)
    acts = play_round(e, peers, 1.0, b"\x01")
    (commit,) = [a for a in acts if isinstance(a, SendCommit)]
    assert commit.epsilon == library_epsilon(1.0, 0.5, 1, 1e-5)


def refused(**settings) -> str:
    with pytest.raises(ConfigError) as exc:
        RunSection(**settings).validate()
    return f"{exc.value.setting}: {exc.value}"


def test_run_settings_refuse_what_cannot_hold():
    assert refused(dp_sigma=1.0, max_norm=1.0, dp_mode="distributed", aggregator="median").startswith("run.dp_mode")
    assert refused(dp_epsilon_budget=3.0).startswith("run.dp_epsilon_budget")
    assert "dp_mode owner" in refused(dp_sigma=1.0, max_norm=1.0, audit_owners=True)
    assert refused(dp_delta=0.0).startswith("run.dp_delta")
    RunSection(dp_sigma=1.0, max_norm=1.0, audit_owners=True, dp_mode="distributed").validate()
    # Contributor noise runs on the ring (no owner needs to see a row); owner noise needs the butterfly.
    assert not RunSection(dp_sigma=1.0, max_norm=1.0, dp_mode="distributed").needs_butterfly()
    assert RunSection(dp_sigma=1.0, max_norm=1.0).needs_butterfly()


def plan(collective="ring", size=3, round_=0):
    return Plan(round=round_, attempt=0, participants=tuple("abc"[:size]), collective=collective,
                shard_bounds=tuple(range(size + 1)), shard_owner=tuple(range(size)),
                num_samples=(10, 20, 30)[:size])


def test_fedavg_contribution_clips_noises_once_per_round_and_weights_uniformly():
    cfg = RunConfig(max_norm=1.0, dp_sigma=0.5, dp_mode="distributed")
    policy = FedAvgContribution(cfg.reduction_spec, dp=cfg.dp_settings, rng=np.random.default_rng(0))
    update = np.full(1000, 1.0, dtype=np.float32)  # norm ~31.6: clipped to 1
    first = policy.prepare(update, plan(), "a")
    assert first.reducer is None
    noise = first.values * 3 - clip_l2(update, 1.0)
    assert noise.std() == pytest.approx(0.5 / math.sqrt(3), rel=0.1)
    again = policy.prepare(update, plan(), "a")  # a retry of the same round: the same values
    assert np.array_equal(again.values, first.values)
    fewer = policy.prepare(update, plan(size=2), "a")  # a retry with fewer survivors: topped up
    assert (fewer.values * 2 - clip_l2(update, 1.0)).std() == pytest.approx(0.5 / math.sqrt(2), rel=0.1)
    later = policy.prepare(update, plan(round_=1), "a")
    assert not np.array_equal(later.values, first.values)
    butterfly = policy.prepare(update, plan("butterfly"), "b")
    assert butterfly.reducer is not None and butterfly.reducer.spec.dp_sigma == 0 and butterfly.reducer.spec.max_norm == 0


def test_epsilon_reaches_the_metric_and_the_status_view():
    m = CoordinatorMetrics()
    m.on_commit(1.0, rounds_committed=3, epsilon=4.25)
    assert m.m["shoal_coordinator_dp_epsilon"]._value.get() == 4.25
    view = {"coordinator": "c:1", "epoch": 1, "round": 3, "rounds_committed": 3, "rounds_aborted": 0,
            "epsilon": 4.25, "dp_delta": 1e-5, "run_config": {}, "members": [], "rounds": [], "waiting": {}}
    assert "epsilon 4.250 (delta 1e-05)" in render_table(view)
    assert "epsilon" not in render_table({**view, "epsilon": 0.0, "dp_delta": 0.0})
    secure = {"secure_aggregation": True, "secagg_degree": 4, "secagg_threshold": 3, "secagg_clip": 4.0,
              "secagg_frac_bits": 20}
    assert "secure aggregation on (degree 4, threshold 3, clip 4.0, 20 fraction bits)" in render_table(
        {**view, "run_config": secure})
    assert "secure aggregation" not in render_table({**view, "run_config": {"compression": "none"}})


async def test_the_coordinator_service_reports_epsilon_in_status_and_the_metric():
    dp = DpSettings(sigma=1.2, clip=1.0, mode="distributed", delta=1e-6)
    e = RoundEngine(EngineConfig(min_peers=2, lease_seconds=1e9, retry_backoff=0.0, privacy=dp))
    svc = coordinator_service(e, clock=0.0)
    for p in "ab":
        svc.apply(e.join(p, bytes(32), f"10.0.0.{p}:1", 1, 0.0))
        e.connected(p, 0.0)
    for r in range(2):
        svc.apply(play_round(e, "ab", 1.0 + r, bytes([r + 1])))
    status = await svc.GetStatus(pb.StatusRequest(), None)
    assert status.epsilon == library_epsilon(1.2, 1.0, 2, 1e-6) and status.dp_delta == 1e-6
    assert svc.metrics.m["shoal_coordinator_dp_epsilon"]._value.get() == status.epsilon
