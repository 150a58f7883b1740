"""The eager outer update through the PyTorch integration's real queues: the agent steps a copy
of the committed outer optimizer on its own fresh term (needs PyTorch)."""

from __future__ import annotations

import queue

import numpy as np
import pytest

pytest.importorskip("torch", reason="PyTorch is not installed (pip install 'shoal[torch]')")

from shoal.peer.fragments import Fragments  # noqa: E402
from shoal.peer.torch_optimizer import TorchWorkload, _Bridge, _Phase  # noqa: E402
from shoal.peer.training import RunConfig  # noqa: E402

def _hand_over(wl: TorchWorkload, local: np.ndarray):
    """The trainer's side of one hand-over through the real bridge: the update in, the agent's
    pseudo-gradient out, and the eager message the agent put on the trainer's queue."""
    wl.bridge.to_agent.put(("update", (local, 0.0, _Phase(2, 2, 0.1))))
    upd = wl.local_update()
    kind, value = wl.bridge.to_trainer.get_nowait()
    while kind == "start":
        kind, value = wl.bridge.to_trainer.get_nowait()
    assert kind == "eager"
    return upd, value


def test_the_agent_steps_a_copy_of_the_committed_optimizer_on_its_own_term():
    """Through TorchWorkload's queues, 4 fragments, 2 sweeps: before any commit no estimate (the
    weight is unknown); afterwards θ_e is the fragment's outer step, on a copy of the committed
    optimizer, of share x this peer's fresh pseudo-gradient (share 1/4 from the last committed
    plan). The committed states carry the same bytes and digests as a run without eager."""
    n = 16
    part = Fragments(n, 4, "contiguous")
    cfg = RunConfig(inner_steps=8, fragments=4, fragment_overlap=1, eager=True)
    plain_cfg = RunConfig(inner_steps=8, fragments=4, fragment_overlap=1)
    rng = np.random.default_rng(3)
    init = rng.standard_normal(n).astype(np.float32)
    wl, plain = (TorchWorkload(c, init, 1, _Bridge()) for c in (cfg, plain_cfg))
    wl.partition = plain.partition = part
    for r in range(8):
        f = r % 4
        local = wl.state.params + rng.standard_normal(n).astype(np.float32) * 0.1
        before = wl.state.outer.state()
        upd, value = _hand_over(wl, local)
        fresh = (part.take(wl.state.params, f) - part.take(local, f)).astype(np.float32)
        assert np.array_equal(upd.pseudo_grad, fresh)
        if r == 0:
            assert value is None
        else:
            estimate, frag = value
            assert frag == f and estimate.shape == (part.sizes[f],)
            want = wl.state.outer.preview_fragment(f, part.take(wl.state.params, f), (0.25 * fresh).astype(np.float32))
            assert estimate.tobytes() == want.tobytes()
        assert all(np.array_equal(wl.state.outer.state()[k], v) for k, v in before.items())
        # The round: the all-reduce of this peer's and three others' pseudo-gradients.
        others = [rng.standard_normal(part.sizes[f]).astype(np.float32) * 0.1 for _ in range(3)]
        aggregate = np.mean([upd.pseudo_grad, *others], axis=0).astype(np.float32)
        plain.bridge.to_agent.put(("update", (local, 0.0, _Phase(2, 2, 0.1))))
        plain.local_update()
        st, ref = wl.tentative(aggregate, share=0.25), plain.tentative(aggregate, share=0.25)
        assert st.to_bytes() == ref.to_bytes() and st.digest() == ref.digest()
        wl.apply(st)
        plain.apply(ref)
        kind, (params, frag) = wl.bridge.to_trainer.get_nowait()
        assert kind == "fragment" and frag == f and np.array_equal(params, st.params)
    kinds = []
    while True:
        try:
            kinds.append(plain.bridge.to_trainer.get_nowait()[0])
        except queue.Empty:
            break
    assert "eager" not in kinds and kinds.count("fragment") == 8  # without eager: no estimate sent
