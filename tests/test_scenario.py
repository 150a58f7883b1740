"""shoal.scenario: parsing and checking scenario files, and the per-event summary (pure)."""

from __future__ import annotations

import re

import pytest

from shoal import scenario
from shoal.scenario import CommitPoint, Event, ScenarioError


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
    ({"event": [{"at": 1, "action": "shape", "peer": 1}]}, "event[0].action"),
    ({"event": [{"at": 1, "action": "kill", "peer": 1, "when": 2}]}, "event[0].when"),
    ({"peer": [{"up_mbit": 20}]}, "peer[0].up_mbit"),
    ({"peer": [{"start": "soon"}]}, "peer[0].start"),
    ({"peer": [{}] * 5}, "peer"),
    ({"peers": []}, "unknown table"),
])
def test_bad_scenarios_name_the_field(raw, field):
    with pytest.raises(ScenarioError, match="^" + re.escape(field)):
        scenario.parse(raw, 4)


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
