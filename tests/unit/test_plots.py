"""`shoal swarm --plot`: loss and accuracy per round, aborted and retried attempts marked."""

from __future__ import annotations

import pytest

from shoal.plots import curves, plot_rounds

EVENTS = [
    {"event": "commit", "round": 0, "attempt": 0, "loss": 1.2, "test_accuracy": 0.6},
    {"event": "commit", "round": 0, "attempt": 0, "loss": 1.2, "test_accuracy": 0.6},  # a second peer's copy
    {"event": "abort", "round": 1, "attempt": 0, "reason": "peer lost", "will_retry": True},
    {"event": "abort", "round": 1, "attempt": 0, "reason": "peer lost", "will_retry": True},
    {"event": "commit", "round": 1, "attempt": 1, "loss": 0.5, "test_accuracy": 0.8},
    {"event": "abort", "round": 2, "attempt": 4, "reason": "too many attempts", "will_retry": False},
    {"event": "commit", "round": 2, "attempt": 5, "loss": 0.3, "test_accuracy": 0.9},
    {"event": "finished", "rounds": 3},
]


def test_curves_dedupe_and_mark_aborts():
    c = curves(EVENTS)
    assert c["round"] == [0, 1, 2] and c["loss"] == [1.2, 0.5, 0.3] and c["accuracy"] == [0.6, 0.8, 0.9]
    assert c["retried"] == [(1, 0)] and c["aborted"] == [(2, 4)]


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib is not installed (pip install shoal[plot])")
    path = tmp_path / "curve.png"
    plot_rounds(EVENTS, str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5000
