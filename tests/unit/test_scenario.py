"""shoal.testbeds.scenario: parsing and checking scenario files, and the per-event summary (pure)."""

from __future__ import annotations

import math
import re

import pytest

from shoal.testbeds import scenario
from shoal.testbeds.scenario import AttemptEnd, CommitPoint, Event, Observed, PeerSpec, Scenario, ScenarioError
from shoal.testbeds.swarm import Swarm, SwarmOptions, abort_kind


def test_parse_sorts_events_and_fills_plain_peers():
    s = scenario.parse({"peer": [{"start": 8.0, "fault": "rs:stop@4"}],
                        "event": [{"at": 20.0, "action": "coordinator-stop"},
                                  {"at": 10.0, "action": "local-work", "peer": 3, "seconds": 90}]}, 4)
    assert [e.action for e in s.events] == ["local-work", "coordinator-stop"]
    assert s.events[0] == Event(10.0, "local-work", 3, 90.0)
    assert s.peer_spec(0).start == 8.0 and s.peer_spec(0).fault == "rs:stop@4"
    assert s.peer_spec(3) == scenario.PeerSpec()


@pytest.mark.parametrize("raw,field", [
    ({"event": [{"at": 1, "action": "explode", "peer": 0}]}, "event[0].action"),
    ({"event": [{"at": 1, "action": "kill", "peer": 4}]}, "event[0].peer"),
    ({"event": [{"at": 1, "action": "kill"}]}, "event[0].peer"),
    ({"event": [{"at": 1, "action": "coordinator-kill", "peer": 1}]}, "event[0].peer"),
    ({"event": [{"at": -1, "action": "kill", "peer": 1}]}, "event[0].at"),
    ({"event": [{"at": 1, "action": "local-work", "peer": 1}]}, "event[0].seconds"),
    ({"event": [{"at": 1, "action": "shape"}]}, "event[0].peer"),
    ({"event": [{"at": 1, "action": "shape", "peer": 1, "up_mbit": 0}]}, "event[0].up_mbit"),
    ({"event": [{"at": 1, "action": "kill", "peer": 1, "down_mbit": 5}]}, "event[0].down_mbit"),
    ({"event": [{"at": 1, "action": "kill", "peer": 1, "when": 2}]}, "event[0].when"),
    ({"peer": [{"up_mbit": -20}]}, "peer[0].up_mbit"),
    ({"peer": [{"down_mbit": "fast"}]}, "peer[0].down_mbit"),
    ({"peer": [{"advertise": "nowhere"}]}, "peer[0].advertise"),
    ({"peer": [{"nat": "yes"}]}, "peer[0].nat"),
    ({"peer": [{"outbound_only": 1}]}, "peer[0].outbound_only"),
    ({"peer": [{"nat": True, "advertise": "refuse"}]}, "peer[0].advertise"),
    ({"peer": [{}, {"nat": True}], "event": [{"at": 1, "action": "nat-rebind", "peer": 0}]}, "event[0].peer"),
    ({"peer": [{"resume_after": -1}]}, "peer[0].resume_after"),
    ({"peer": [{"start": "soon"}]}, "peer[0].start"),
    ({"peer": [{}] * 5}, "peer"),
    ({"peers": []}, "unknown table"),
    ({"peer": [{"fault": "rs:stop@x"}]}, "peer[0].fault"),
    ({"peer": [{"fault": "bogus"}]}, "peer[0].fault"),
    ({"peer": [{"fault": "ag:explode"}]}, "peer[0].fault"),
    ({"event": [{"at": 1, "action": "relay-kill", "relay": -1}]}, "event[0].relay"),
    ({"event": [{"at": 1, "action": "relay-start", "peer": 0}]}, "event[0].peer"),
    ({"event": [{"at": 1, "action": "kill", "peer": 0, "relay": 0}]}, "event[0].relay"),
])
def test_bad_scenarios_name_the_field(raw, field):
    with pytest.raises(ScenarioError, match="^" + re.escape(field)):
        scenario.parse(raw, 4)


def test_relay_events_name_a_relay_and_report_the_next_commit():
    sc = scenario.parse({"event": [{"at": 10, "action": "relay-kill"}, {"at": 15, "action": "relay-start",
                                                                          "relay": 1}]}, 4)
    assert [(e.action, e.relay, e.peer) for e in sc.events] == [("relay-kill", 0, None), ("relay-start", 1, None)]
    out = scenario.event_report(sc.events[1], 16.0, [CommitPoint(12.0, 3, frozenset({0})),
                                                     CommitPoint(19.5, 4, frozenset({0, 1}))], 4)
    assert out["relay"] == 1 and out["next_commit_seconds"] == 3.5


def test_load_names_the_file(tmp_path):
    bad = tmp_path / "s.toml"
    bad.write_text('[[event]]\nat = 1\naction = "kill"\npeer = 9\n')
    with pytest.raises(ScenarioError, match=r"s\.toml: event\[0\]\.peer"):
        scenario.load(str(bad), 4)
    with pytest.raises(ScenarioError, match="missing.toml"):
        scenario.load(str(tmp_path / "missing.toml"), 4)


def test_max_commit_gap_counts_from_the_last_commit_before_the_start():
    # commits every 0.1 s, then a 2 s stall that began before `start` = 10.0
    times = [9.0 + 0.1 * k for k in range(6)] + [11.5, 11.6, 11.7]
    assert scenario.max_commit_gap(times, 10.0) == pytest.approx(11.5 - 9.5)
    assert scenario.max_commit_gap(times, 50.0) is None  # nothing after: no gap to speak of
    assert scenario.max_commit_gap([], 0.0) is None


def test_event_report_for_a_local_work():
    commits = [CommitPoint(t, r, frozenset({0, 1, 2} if t < 100.3 else {0, 1, 2, 3}))
               for r, t in enumerate([99.8, 99.9, 100.0, 100.1, 100.2, 100.4, 100.5])]
    ev = Event(10.0, "local-work", 3, 90.0)
    rep = scenario.event_report(ev, 100.05, commits)
    assert rep["peer_next_commit_seconds"] == pytest.approx(0.35)
    assert rep["max_commit_gap_seconds_30s"] == pytest.approx(0.2)
    assert rep["done_after_start_seconds"] == 100.05 and rep["seconds"] == 90.0
    never = scenario.event_report(ev, None, commits)
    assert never["peer_next_commit_seconds"] is None and never["max_commit_gap_seconds_30s"] is None


# ------------------------------------------------------------------ shaping and the run's tables


def test_shaping_is_parsed_and_says_it_needs_namespaces():
    s = scenario.parse({"peer": [{"up_mbit": 20, "down_mbit": 4}, {"advertise": "refuse"}],
                        "event": [{"at": 25, "action": "shape", "peer": 3, "up_mbit": 10}]}, 4)
    assert s.peer_spec(0).up_mbit == 20.0 and s.peer_spec(0).down_mbit == 4.0 and s.peer_spec(0).shaped
    assert s.events[0] == Event(25.0, "shape", 3, 0.0, 10.0, None)  # omitted rate = unshaped
    assert s.needs_netns == "peer[0].up_mbit"
    assert scenario.parse({"peer": [{"advertise": "drop"}]}, 2).needs_netns == "peer[0].advertise"
    assert "shape event at 3s" in scenario.parse({"event": [{"at": 3, "action": "shape", "peer": 0}]}, 2).needs_netns
    # Without shaping (and without "drop") it runs on loopback as before.
    assert scenario.parse({"peer": [{"fault": "rs:stop@4", "advertise": "refuse"}],
                           "event": [{"at": 1, "action": "coordinator-stop"}]}, 4).needs_netns == ""


def test_nat_is_parsed_and_needs_namespaces():
    s = scenario.parse({"peer": [{}, {"nat": True}],
                        "event": [{"at": 12, "action": "nat-rebind", "peer": 1}]}, 3)
    assert s.peer_spec(1).nat and not s.peer_spec(0).nat and not s.peer_spec(2).nat
    assert s.needs_netns == "peer[1].nat"
    assert s.events[0] == Event(12.0, "nat-rebind", 1)
    win = scenario.touch_windows(s, 3, Observed())
    assert win[1] == [(12.0, 12.0 + scenario.TOUCH_GRACE_SECONDS)] and win[0] == []
    flagged = scenario.parse({"peer": [{"outbound_only": True}]}, 2)
    assert flagged.peer_spec(0).outbound_only and flagged.needs_netns == ""


def test_latency_is_parsed_and_needs_the_delay_line():
    s = scenario.parse({"peer": [{"rtt_ms": 100, "loss": 0.001}, {}],
                        "path": [{"a": 0, "b": "coordinator", "rtt_ms": 300, "jitter_ms": 5}],
                        "event": [{"at": 9, "action": "latency", "peer": 1, "rtt_ms": 40}]}, 3)
    assert s.peer_spec(0).latency == scenario.LatencySpec(100.0, 0.0, 0.001)
    assert s.peer_spec(1).latency is None
    assert s.paths == (scenario.PathSpec(0, -1, scenario.LatencySpec(300.0, 5.0, 0.0)),)
    assert s.events[0].latency == scenario.LatencySpec(40.0)
    assert s.needs_netns == "peer[0].rtt_ms" and s.has_latency
    assert scenario.parse({"path": [{"a": 0, "b": 1, "loss": 0.01}]}, 2).needs_netns == "path[0]"
    assert "latency event" in scenario.parse({"event": [{"at": 1, "action": "latency", "peer": 0}]}, 2).needs_netns
    assert not scenario.parse({"peer": [{"up_mbit": 5}]}, 2).has_latency
    win = scenario.touch_windows(s, 3, Observed())
    assert win[1] == [(9.0, 9.0 + scenario.TOUCH_GRACE_SECONDS)]
    report = scenario.event_report(s.events[0], 9.5, [], 3)
    assert (report["rtt_ms"], report["loss"]) == (40.0, 0.0)


@pytest.mark.parametrize("raw,field", [
    ({"peer": [{"rtt_ms": -1}]}, "peer[0].rtt_ms"),
    ({"peer": [{"rtt_ms": 10, "jitter_ms": 6}]}, "peer[0].jitter_ms"),
    ({"peer": [{"loss": 1.0}]}, "peer[0].loss"),
    ({"peer": [{"rtt_ms": 10, "nat": True}]}, "peer[0].nat"),
    ({"path": [{"a": 0, "b": 0, "rtt_ms": 10}]}, "path[0].b"),
    ({"path": [{"a": 0, "b": 7}]}, "path[0].b"),
    ({"path": [{"a": "root", "b": 1}]}, "path[0].a"),
    ({"path": [{"a": 0, "b": 1, "up_mbit": 4}]}, "path[0].up_mbit"),
    ({"path": {"a": 0}}, "path:"),
    ({"event": [{"at": 1, "action": "shape", "peer": 0, "rtt_ms": 50}]}, "event[0].rtt_ms"),
    ({"peer": [{"nat": True}], "event": [{"at": 1, "action": "latency", "peer": 0, "rtt_ms": 5}]}, "event[0].peer"),
])
def test_bad_latency_names_the_field(raw, field):
    with pytest.raises(ScenarioError, match=re.escape(field)):
        scenario.parse(raw, 2)


def _ev(kind, t, rnd, att, **kw):
    return {"event": kind, "t": t, "round": rnd, "attempt": att, **kw}


def test_rounds_report_maps_ids_times_and_plans():
    ids = {"a": 0, "b": 1, "c": 2}
    t0 = 1000.0
    events = {
        0: [_ev("plan", 1001.0, 0, 1000, collective="ring", participants=["a", "b", "c"], demoted=["c"],
                predicted_seconds=0.5),
            _ev("abort", 1003.5, 0, 1000), _ev("plan", 1004.0, 0, 1001, collective="butterfly",
                                                participants=["a", "b"], demoted=[], predicted_seconds=0.4),
            _ev("commit", 1004.6, 0, 1001)],
        1: [_ev("plan", 1001.2, 0, 1000, collective="ring", participants=["a", "b", "c"], demoted=["c"],
                predicted_seconds=0.5), _ev("abort", 1003.2, 0, 1000)],
    }
    ends = [AttemptEnd(0, 1001, True, ("a", "b"), (), 0.55),
            AttemptEnd(0, 1000, False, (), ("c",), None, "peer failed: no chunk from c within 2.0s")]
    rows = scenario.rounds_report(ends, events, t0, ids)
    assert [(r["round"], r["attempt"], r["status"]) for r in rows] == [(0, 0, "aborted"), (0, 1, "committed")]
    abort, commit = rows
    assert abort["participants"] == [0, 1, 2] and abort["excluded"] == [2] and abort["demoted"] == [2]
    assert abort["collective_algorithm"] == "ring" and abort["predicted_seconds"] == 0.5
    assert abort["seconds"] == pytest.approx(3.2 - 1.0)  # first plan received -> first abort heard
    assert abort["at_seconds"] == pytest.approx(3.2)
    assert commit["seconds"] == 0.55 and commit["participants"] == [0, 1] and commit["collective_algorithm"] == "butterfly"
    # An attempt no peer recorded the plan of still gets a row, with what the coordinator knows.
    bare = scenario.rounds_report([AttemptEnd(1, 0, False, (), ("zz",))], {}, t0, ids)[0]
    assert bare["collective_algorithm"] is None and bare["seconds"] is None and bare["excluded"] == [-1]


def test_per_peer_report():
    events = {0: [_ev("commit", 110.0, 0, 0), _ev("commit", 111.0, 1, 0), _ev("commit", 111.5, 1, 0)],
              1: [{"event": "state_sync", "t": 130.0, "seconds": 20.5, "bytes": 9_800_000, "round": 3},
                  _ev("commit", 131.0, 3, 0)]}
    rows = [{"excluded": [1]}, {"excluded": [1, 2]}, {"excluded": []}]
    pp = scenario.per_peer_report(events, {0: 100.0, 1: 108.0}, rows, 3)
    assert pp[0]["rounds_committed"] == 2 and pp[0]["first_commit_after_start_seconds"] == 10.0
    assert pp[1]["first_commit_after_start_seconds"] == 23.0 and pp[1]["state_syncs"] == 1
    assert pp[1]["first_state_sync_seconds"] == 20.5 and pp[1]["first_state_sync_bytes"] == 9_800_000
    assert [p["times_excluded"] for p in pp] == [0, 2, 1]
    assert pp[2]["rounds_committed"] == 0 and pp[2]["first_commit_after_start_seconds"] is None


def test_touch_windows_follow_faults_and_events():
    plan = Scenario(
        peers=(PeerSpec(fault="rs:stop@4"), PeerSpec(advertise="drop"), PeerSpec(fault="ag:kill@2"), PeerSpec()),
        events=(Event(10.0, "stop", 3), Event(15.0, "cont", 3), Event(20.0, "coordinator-stop"),
                Event(30.0, "shape", 3, up_mbit=10.0), Event(50.0, "kill", 3)))
    w = scenario.touch_windows(plan, 5, Observed({0: [(12.0, 32.0), (60.0, None)]}), grace=10.0)
    assert w[0] == [(12.0, 42.0), (60.0, math.inf)]  # a stop fault: from the stop seen to resume + grace
    assert w[1] == [(0.0, math.inf)] and w[2] == [(0.0, math.inf)]  # unreachable / other faults: whole run
    assert w[3] == [(10.0, 25.0), (30.0, 40.0), (50.0, math.inf)]  # stop..cont+grace, shape, kill never restarted
    assert w[4] == []  # the coordinator's stall touches no peer


def test_wrongful_exclusions_count_only_untouched_peers():
    windows = {0: [(12.0, 42.0)], 1: [], 2: [(0.0, math.inf)]}
    rows = [{"round": 4, "attempt": 0, "excluded": [1], "at_seconds": 14.0},   # healthy peer: wrongful
            {"round": 4, "attempt": 1, "excluded": [0], "at_seconds": 16.0},   # the stalled one: right
            {"round": 9, "attempt": 0, "excluded": [0], "at_seconds": 50.0},   # after its window: wrongful
            {"round": 9, "attempt": 1, "excluded": [2, 1], "at_seconds": None}]  # no time: untouched only
    wrong = scenario.wrongful_exclusions(rows, windows)
    assert [(x["round"], x["attempt"], x["peer"]) for x in wrong] == [(4, 0, 1), (9, 0, 0), (9, 1, 1)]
    assert scenario.wrongful_exclusions([], windows) == []


def test_joins_from_the_coordinator_log_and_next_commits_after_a_coordinator_event():
    ids = {"aaaaaaaa" + "0" * 24: 0, "bbbbbbbb" + "0" * 24: 1}
    lines = ["12:00:01 INFO shoal.coordinator.server: peer aaaaaaaa joined from 10.0.0.1:7000",
             "12:00:01 INFO shoal.coordinator.server: peer bbbbbbbb joined from 10.0.0.2:7000",
             "12:00:31 INFO shoal.coordinator.server: peer aaaaaaaa joined from 10.0.0.1:7000 (token x)",
             "12:00:31 INFO shoal.coordinator.server: peer cccccccc joined from 10.0.0.9:7000"]
    assert scenario.joins_from_log(lines, ids, 3) == [2, 1, 0]
    assert scenario.joins_from_log(["12:00:00 WARNING something else"], ids, 2) is None
    commits = [CommitPoint(41.0, 9, frozenset({0, 1})), CommitPoint(45.0, 10, frozenset({0, 1, 2}))]
    rep = scenario.event_report(Event(40.0, "coordinator-cont"), 40.0, commits, num_peers=4)
    assert rep["peers_next_commit_seconds"] == [1.0, 1.0, 5.0, None]


def test_shaping_without_namespaces_is_refused_in_one_line(monkeypatch):
    from shoal.testbeds import swarm

    monkeypatch.setattr(swarm.NetBed, "available", staticmethod(lambda: (False, "NetBed needs root")))
    shaped = scenario.parse({"peer": [{"up_mbit": 20}]}, 3)
    why = swarm.netns_refusal(shaped)
    assert why.startswith("peer[0].up_mbit needs the network-namespace runner") and "root" in why and "\n" not in why
    assert swarm.netns_refusal(scenario.parse({"peer": [{"fault": "rs:stop@4"}]}, 3)) == ""  # loopback as before


def test_round_0_waits_only_for_the_peers_that_start_with_the_coordinator(tmp_path):
    # A late joiner (start > 0) joins a running swarm: round 0 does not wait for it (it did, so
    # the slow joiner of examples/scenarios/slow-joiner-4mbit.toml played round 0 and never joined).
    sc = scenario.parse({"peer": [{}, {}, {}, {"start": 8.0}]}, 4)
    argv = Swarm(SwarmOptions(peers=4, scenario=sc, progress=False), tmp_path).coordinator_argv()
    assert argv[argv.index("--initial-peers") + 1] == "3"
    argv = Swarm(SwarmOptions(peers=4, progress=False), tmp_path / "plain").coordinator_argv()
    assert argv[argv.index("--initial-peers") + 1] == "4"


def test_abort_reasons_are_counted_by_kind_not_by_first_word():
    assert abort_kind("1fe2caf6 failed: no chunk from 0cd28a17 within 15.3s (phase 2, step 0)") == \
        "no chunk from <peer> within Ns"
    assert abort_kind("lease expired") == "lease expired"
    assert abort_kind("9d402815 failed: InjectedFault: fault injection: reduce raised in round 2") == \
        "InjectedFault: fault injection: reduce raised in"
    assert abort_kind("f9611c5a lost before voting (participant f9611c5a disconnected)") == "<peer> lost before voting"


FIVE_PEERS = "".join(f"[[peer]]\nstart = {i}.0\n" for i in range(5))


def test_a_scenario_that_lists_its_peers_sets_the_swarm_size(tmp_path):
    from shoal.cli import UsageError, _swarm_size
    from shoal.config import SwarmSection

    path = tmp_path / "five.toml"
    path.write_text(FIVE_PEERS)
    assert scenario.listed_peers(str(path)) == 5
    s = SwarmSection(scenario=str(path))
    assert _swarm_size(s, frozenset()).peers == 5  # no --peers: the tables' count
    assert _swarm_size(SwarmSection(scenario=str(path), peers=7), frozenset({"swarm.peers"})).peers == 7
    empty = tmp_path / "none.toml"
    empty.write_text('[[event]]\nat = 1.0\naction = "coordinator-stop"\n')
    assert _swarm_size(SwarmSection(scenario=str(empty)), frozenset()).peers == SwarmSection().peers
    missing = SwarmSection(scenario=str(tmp_path / "absent.toml"))
    with pytest.raises(UsageError, match="absent.toml"):
        _swarm_size(missing, frozenset())


def test_an_explicit_peers_below_the_scenario_tables_is_one_line_in_words(tmp_path):
    import subprocess
    import sys

    path = tmp_path / "five.toml"
    path.write_text(FIVE_PEERS)
    proc = subprocess.run([sys.executable, "-m", "shoal.cli", "swarm", "--scenario", str(path), "--peers", "4",
                           "--no-progress", "--workdir", str(tmp_path / "wd")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert "lists 5 peers" in proc.stderr and "--peers is 4" in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_two_coordinators_without_the_etcd_binary_is_one_line(tmp_path):
    import os
    import subprocess
    import sys

    bare = tmp_path / "bin"
    bare.mkdir()
    env = {**os.environ, "PATH": str(bare)}  # no etcd on it (python is started by its full path)
    proc = subprocess.run([sys.executable, "-m", "shoal.cli", "swarm", "--coordinators", "2", "--no-progress",
                           "--workdir", str(tmp_path / "wd")], capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 2, proc.stderr
    assert "etcd" in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
