"""The PyTorch integration: examples/torch_digits.py (coordinator + 3 peer processes, DiLoCo)
reaches the accuracy stated in the README, every peer ends with the same model."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("torch", reason="PyTorch is not installed (pip install 'shoal[torch]')")

ROOT = pathlib.Path(__file__).resolve().parents[1]
STATED_ACCURACY = 0.93  # README, "PyTorch integration"


@pytest.mark.torch
@pytest.mark.integration
@pytest.mark.timeout(300)
def test_torch_digits_example_reaches_stated_accuracy(tmp_path):
    out = tmp_path / "result.json"
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "torch_digits.py"), "--peers", "3", "--rounds", "12",
                           "--inner-steps", "25", "--timeout", "240", "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    result = json.loads(out.read_text())
    accs = [p["test_accuracy"] for p in result["per_peer"]]
    assert min(accs) >= STATED_ACCURACY, accs
    assert len(set(accs)) == 1, "peers ended with different models"
    assert all(p["rounds"] == 12 for p in result["per_peer"])


@pytest.mark.torch
def test_flatten_round_trip():
    import numpy as np
    import torch

    from shoal.peer.torch_integration import flatten, unflatten_into

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    flat = flatten(model)
    assert flat.dtype == np.float32 and flat.shape == (4 * 3 + 3 + 3 * 2 + 2,)
    unflatten_into(model, np.zeros_like(flat))
    assert all(float(p.detach().abs().sum()) == 0.0 for p in model.parameters())
    unflatten_into(model, flat)
    assert np.array_equal(flatten(model), flat)
    with pytest.raises(ValueError):
        unflatten_into(model, np.zeros(3, dtype=np.float32))
