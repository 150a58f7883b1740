"""examples/hf_causal_lm.py: a Hugging Face GPT-2-style causal LM trained by 3 peers with
shoal.torch.DiLoCoOptimizer; its validation loss falls and, from a shared warm start, ends within
5 % of a single process trained on the same batches for the same steps (docs/training.md)."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("torch", reason="PyTorch is not installed (pip install 'shoal[torch]')")
pytest.importorskip("transformers", reason="transformers is not installed (pip install 'shoal[hf]')")

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.torch
@pytest.mark.timeout(300)
def test_hf_causal_lm_runs_in_the_default_suite_with_a_tiny_model(tmp_path):
    """The example as a user runs it, at the smallest size that still trains: 2 peers, a 1-layer
    GPT-2 of 21,984 parameters, 2 rounds of 5 inner steps (about 20 s on 2 cores)."""
    out = tmp_path / "summary.json"
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "hf_causal_lm.py"), "--peers", "2", "--rounds", "2",
                           "--inner-steps", "5", "--width", "32", "--layers", "1", "--heads", "2", "--context", "32",
                           "--batch-size", "4", "--json", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    s = json.loads(out.read_text())
    assert s["params"] == 21984 and s["rounds"] == 2
    assert s["swarm_val_loss"] < s["swarm_val_loss_initial"] - 0.3  # 5.47 -> 4.86 nats/byte here
    assert len(s["per_peer"]) == 2 and len({p["val_loss"] for p in s["per_peer"]}) == 1  # one committed model


@pytest.mark.torch
@pytest.mark.soak  # about 5 minutes on 2 cores: 3 LM peers, then the single-process run
@pytest.mark.timeout(1500)
def test_hf_causal_lm_with_3_peers_matches_one_process_within_5_percent(tmp_path):
    out = tmp_path / "summary.json"
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "hf_causal_lm.py"), "--peers", "3", "--rounds", "6",
                           "--inner-steps", "20", "--width", "128", "--layers", "2", "--warm-start-steps", "240",
                           "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=1400)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    s = json.loads(out.read_text())
    assert s["swarm_val_loss"] < s["swarm_val_loss_initial"] - 0.1
    assert len({p["val_loss"] for p in s["per_peer"]}) == 1  # one committed model
    assert s["val_loss_ratio"] <= 1.05, s
