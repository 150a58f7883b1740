"""The PyTorch integration: examples/torch_digits.py (coordinator + 3 peer processes, DiLoCo)
reaches the accuracy stated in the README, every peer ends with the same model."""

from __future__ import annotations


import pytest

pytest.importorskip("torch", reason="PyTorch is not installed (pip install 'shoal[torch]')")


@pytest.mark.torch
def test_flatten_round_trip():
    import numpy as np
    import torch

    from shoal.torch import flatten, unflatten_into

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
