"""Link measurement: pure LinkMeter arithmetic (probes of a real peer: tests/component/test_link_probes.py)."""

from __future__ import annotations

import pytest

from shoal.common.errors import InvalidArgument
from shoal.coordinator.server import check_link_report
from shoal.peer.links import MIN_PROBE_BYTES, PROBE_BYTES, LinkMeter
from shoal.v1 import shoal_pb2 as pb


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_probe_sets_capacity_and_passive_only_raises_it():
    clock = Clock()
    m = LinkMeter(alpha=0.5, probe_interval=60.0, clock=clock)
    assert m.needs_probe("b")
    m.observe_probe("b", rtt=0.01, up=100.0e6, down=50.0e6)
    assert not m.needs_probe("b")
    # A slow passive stream (shared upload, waiting for others) is a lower bound: no change.
    m.observe_send("b", 10_000_000, 1.0)
    (v,) = m.links()
    assert v.up_bytes_per_s == 100.0e6 and v.down_bytes_per_s == 50.0e6 and v.rtt_seconds == 0.01
    # A faster real transfer raises the estimate.
    m.observe_receive("b", 80_000_000, 1.0)
    assert m.links()[0].down_bytes_per_s == 80.0e6
    clock.t = 61.0
    assert m.needs_probe("b")  # probes are refreshed: only they can lower an estimate


def test_aggregate_is_the_fastest_path_and_tiny_samples_are_ignored():
    m = LinkMeter()
    m.observe_probe("b", rtt=0.02, up=10e6, down=30e6)
    m.observe_probe("c", rtt=0.04, up=20e6, down=5e6)
    m.observe_send("d", 100, 1.0)  # too few bytes to say anything
    m.observe_collective(sent=50_000_000, received=10_000_000, seconds=1.0)
    up, down, rtt = m.aggregate()
    assert up == 50e6 and down == 30e6 and rtt == pytest.approx(0.03)
    rep = m.report("me")
    assert rep.peer_id == "me" and rep.up_bytes_per_s == 50e6
    assert [l.peer_id for l in rep.links] == ["b", "c"]


def test_a_known_link_is_probed_with_about_a_second_of_its_slower_rate_each_way():
    m = LinkMeter()
    assert m.probe_bytes("b") == PROBE_BYTES  # nothing known: the full probe
    m.observe_collective(sent=1_000_000, received=2_000_000, seconds=2.0)  # this peer: 0.5 MB/s up
    assert m.probe_bytes("b") == 500_000  # an unknown link: this peer's own (slower) rate
    m.observe_probe("b", rtt=0.01, up=500_000.0, down=2_000_000.0)  # 4 Mbit/s up
    assert m.probe_bytes("b") == 500_000  # a second each way, not 1 MiB (2 s each way)
    m.observe_probe("c", rtt=0.01, up=100e6, down=100e6)
    assert m.probe_bytes("c") == PROBE_BYTES  # never more than the full probe
    m.observe_probe("d", rtt=0.01, up=10_000.0, down=10_000.0)
    assert m.probe_bytes("d") == MIN_PROBE_BYTES  # nor less than a sample that says something


def test_the_report_clamps_estimates_into_the_bounds_the_coordinator_accepts():
    m = LinkMeter()
    m.observe_probe("b", rtt=120.0, up=10.0, down=5e12)
    rep = m.report("me")
    (b,) = rep.links
    assert (b.up_bytes_per_s, b.down_bytes_per_s, b.rtt_seconds) == (1e3, 1e12, 60.0)
    check_link_report(rep)  # an honest peer's report is never refused


@pytest.mark.parametrize("rtt", [-0.1, float("nan"), float("inf"), 61.0])
def test_a_link_report_with_a_bad_coordinator_rtt_is_refused_naming_the_field(rtt):
    with pytest.raises(InvalidArgument, match="coordinator_rtt_seconds"):
        check_link_report(pb.LinkReport(peer_id="me", coordinator_rtt_seconds=rtt))
    check_link_report(pb.LinkReport(peer_id="me", coordinator_rtt_seconds=0.24))
