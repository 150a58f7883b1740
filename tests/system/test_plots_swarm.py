"""`shoal swarm --plot`: loss and accuracy per round, aborted and retried attempts marked."""

from __future__ import annotations

import pytest


@pytest.mark.integration
def test_swarm_plot_flag(tmp_path):
    """End to end: a short swarm writes the plot and lists it in the summary."""
    pytest.importorskip("matplotlib", reason="matplotlib is not installed (pip install shoal[plot])")
    import json

    from shoal.testbeds.swarm import SwarmOptions, run_swarm

    summary = run_swarm(SwarmOptions(peers=2, rounds=3, inner_steps=5, progress=False, timeout=120,
                                     plot_path=str(tmp_path / "c.png"), summary_path=str(tmp_path / "s.json")))
    assert summary["ok"], summary
    assert json.loads((tmp_path / "s.json").read_text())["plot"] == str(tmp_path / "c.png")
    assert (tmp_path / "c.png").stat().st_size > 5000
