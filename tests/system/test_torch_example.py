"""The PyTorch integration: examples/torch_digits.py (coordinator + 3 peer processes, DiLoCo), its
peers seeded differently, reaches the accuracy stated in the README; round 0 starts every peer
from one state (the same committed digest, all 3 taking part) and every peer ends with the same
model."""

from __future__ import annotations

import json
import pathlib
import sys

import pytest

from kits.procs import run_to_end

pytest.importorskip("torch", reason="PyTorch is not installed (pip install 'shoal[torch]')")

ROOT = pathlib.Path(__file__).resolve().parents[2]
STATED_ACCURACY = 0.93  # README, "PyTorch integration"


@pytest.mark.torch
@pytest.mark.integration
@pytest.mark.timeout(300)
def test_torch_digits_example_reaches_stated_accuracy(tmp_path):
    out = tmp_path / "result.json"
    proc = run_to_end([sys.executable, str(ROOT / "examples" / "torch_digits.py"), "--peers", "3", "--rounds", "12",
                           "--inner-steps", "25", "--timeout", "240", "--json", str(out), "--different-seeds"],
                          cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    result = json.loads(out.read_text())
    accs = [p["test_accuracy"] for p in result["per_peer"]]
    assert min(accs) >= STATED_ACCURACY, accs
    assert len(set(accs)) == 1, "peers ended with different models"
    assert len({p["params_digest"] for p in result["per_peer"]}) == 1
    round0 = {p["commit_digests"]["0"] for p in result["per_peer"]}
    assert len(round0) == 1 and all(p["round0_participants"] == 3 for p in result["per_peer"]), result["per_peer"]
    assert all(p["rounds"] == 12 for p in result["per_peer"])
