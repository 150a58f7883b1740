"""shoal.torch without a swarm: the security refusal, the user's own outer optimizer (bit-identical,
serializable), the host buffers, the deprecated alias, the public names."""

from __future__ import annotations

import copy
import importlib
import sys
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install 'shoal[torch]')")

import shoal.torch as st  # noqa: E402
from shoal.peer.training import CommittedState, RunConfig  # noqa: E402

pytestmark = pytest.mark.torch


def _model(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3)).to(dtype)


def test_neither_tls_dir_nor_insecure_is_refused_in_one_line_saying_what_to_pass():
    with pytest.raises(ValueError) as err:
        st.SwarmOptimizer(_model(), torch.optim.SGD(_model().parameters(), lr=0.1), coordinator="127.0.0.1:1")
    msg = str(err.value)
    assert "\n" not in msg and "tls_dir=DIR" in msg and "insecure=True" in msg


def test_tls_dir_without_ca_pem_and_both_choices_are_refused(tmp_path):
    from shoal.peer.torch_optimizer import security_of

    with pytest.raises(ValueError, match="missing ca.pem"):
        security_of(tmp_path, False)
    with pytest.raises(ValueError, match="no such directory"):
        security_of(tmp_path / "nope", False)
    with pytest.raises(ValueError, match="exclude each other"):
        security_of(tmp_path, True)
    (tmp_path / "ca.pem").write_text("x")
    assert security_of(tmp_path, False).tls_dir == str(tmp_path)


def test_insecure_warns_once_per_call_site():
    from shoal.peer.torch_optimizer import security_of

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("default")
        for _ in range(3):
            assert security_of(None, True).insecure
    assert [w.category for w in seen] == [st.InsecureWarning]


def test_a_peer_config_field_of_the_optimizer_itself_is_refused():
    m = _model()
    with pytest.raises(ValueError, match="connect_timeout: an argument of the optimizer itself"):
        st.DiLoCoOptimizer(m, torch.optim.SGD(m.parameters(), lr=0.1), coordinator="127.0.0.1:1", insecure=True,
                           connect_timeout=1)


def test_torch_outer_matches_torch_sgd_nesterov_on_the_model_and_is_bit_identical():
    """The user's outer optimizer on shadows gives what the same torch optimizer gives on the model
    itself with grad = pseudo-gradient; two peers' copies agree to the bit."""
    model = _model()
    params = list(model.parameters())
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    a, b = st.TorchOuter(outer, params), st.TorchOuter(outer, params)
    theta = st.flatten(model)
    rng = np.random.default_rng(0)
    grads = [rng.standard_normal(theta.size).astype(np.float32) for _ in range(3)]
    ta = tb = theta
    for g in grads:
        ta, tb = a.step(ta, g), b.step(tb, g)
        offset = 0  # the reference: the same optimizer on the model's own parameters
        for p in params:
            p.grad = torch.from_numpy(g[offset:offset + p.numel()].copy()).view_as(p)
            offset += p.numel()
        outer.step()
    assert ta.tobytes() == tb.tobytes()
    np.testing.assert_array_equal(ta, st.flatten(model))
    assert a.name == "torch.SGD" and int(a.state()["step"]) == 3


def test_torch_outer_state_survives_deepcopy_and_the_committed_state_serialization():
    model = _model()
    outer = st.TorchOuter(torch.optim.Adam(model.parameters(), lr=0.01), list(model.parameters()))
    theta = st.flatten(model)
    g = np.full(theta.size, 0.5, dtype=np.float32)
    theta1 = outer.step(theta, g)
    twin = copy.deepcopy(outer)
    assert twin.step(theta1, g).tobytes() == outer.step(theta1, g).tobytes()
    state = CommittedState(theta1, outer, 2)
    fresh = lambda: st.TorchOuter(torch.optim.Adam(model.parameters(), lr=0.01), list(model.parameters()))  # noqa: E731
    back = CommittedState.from_bytes(state.to_bytes(), RunConfig(), fresh)
    assert back.digest() == state.digest() and back.rounds == 2
    assert back.outer.step(theta1, g).tobytes() == copy.deepcopy(outer).step(theta1, g).tobytes()


def test_torch_outer_must_cover_exactly_the_model_parameters():
    model = _model()
    with pytest.raises(ValueError, match="exactly the model's parameters"):
        st.TorchOuter(torch.optim.SGD(list(model.parameters())[:2], lr=0.7), list(model.parameters()))


def test_torch_outer_refuses_a_bad_pseudo_gradient_and_keeps_its_state():
    from shoal.common.errors import InvalidArgument

    model = _model()
    outer = st.TorchOuter(torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9), list(model.parameters()))
    theta = st.flatten(model)
    with pytest.raises(InvalidArgument, match="pseudo_grad: must be finite"):
        outer.step(theta, np.full(theta.size, np.nan, dtype=np.float32))
    assert int(outer.state()["step"]) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_host_buffer_is_allocated_once_and_round_trips_any_dtype(dtype):
    model = _model(dtype=dtype)
    buf = st.HostBuffer(list(model.parameters()))
    ptr = buf.buffer.data_ptr()
    flat = buf.gather().copy()
    assert flat.dtype == np.float32 and flat.shape == (sum(p.numel() for p in model.parameters()),)
    buf.scatter(np.zeros_like(flat))
    assert all(float(p.detach().abs().sum()) == 0.0 for p in model.parameters())
    buf.scatter(flat)
    assert np.array_equal(buf.gather(), flat) and buf.buffer.data_ptr() == ptr
    assert not buf.cuda


def test_host_buffer_on_cuda_is_pinned():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device here: the pinned-buffer path runs on a GPU machine only")
    model = _model().cuda()
    buf = st.HostBuffer(list(model.parameters()))
    assert buf.cuda and buf.buffer.is_pinned()
    flat = buf.gather().copy()
    buf.scatter(flat * 2)
    np.testing.assert_array_equal(buf.gather(), flat * 2)
    assert all(p.device.type == "cuda" for p in model.parameters())


def test_the_old_module_path_is_a_deprecated_alias():
    sys.modules.pop("shoal.peer.torch_integration", None)
    with pytest.warns(DeprecationWarning, match="import shoal.torch"):
        old = importlib.import_module("shoal.peer.torch_integration")
    assert old.DiLoCoOptimizer is st.DiLoCoOptimizer


def test_public_names_and_the_optimizers_are_torch_optimizers():
    assert set(st.__all__) >= {"DiLoCoOptimizer", "FedAvgOptimizer", "RoundTimeout", "SwarmError"}
    assert issubclass(st.DiLoCoOptimizer, torch.optim.Optimizer)
    assert issubclass(st.RoundTimeout, st.SwarmError)
    assert "Args:" in st.SwarmOptimizer.__doc__ and "round_timeout" in st.SwarmOptimizer.__doc__
    assert not hasattr(st, "TrainerTimes") and not hasattr(st, "ComputeLedger")
