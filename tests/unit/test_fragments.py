"""Streaming DiLoCo's fragments: the partitions cover every parameter once, the staggered
schedule, per-fragment outer state serialised bit for bit, a round touches only its fragment,
the engine's plans say which fragment they carry, and the traffic figures of the summary."""

from __future__ import annotations

import numpy as np
import pytest

from shoal.bench.lm_job import peak_rate, traffic
from shoal.common.errors import InvalidArgument
from shoal.common.plan import Plan
from shoal.coordinator.rounds import EngineConfig, ReadyInfo, RoundEngine, SendPlan
from shoal.peer.fragments import Fragments, FragmentedOuter, fragment_of, layer_of
from shoal.peer.outer import DiLoCo
from shoal.peer.training import CommittedState, FlatStateWorkload, RunConfig, make_outer_for
from shoal.v1 import shoal_pb2 as pb

LAYOUT = (("embed.weight", (256, 8)), ("pos", (16, 8)), ("blocks.0.qkv.weight", (24, 8)),
          ("blocks.0.qkv.bias", (24,)), ("blocks.1.qkv.weight", (24, 8)), ("blocks.1.qkv.bias", (24,)),
          ("ln.weight", (8,)), ("ln.bias", (8,)))
N = 256 * 8 + 16 * 8 + 2 * (24 * 8 + 24) + 16


def _covers_once(part: Fragments) -> None:
    allidx = np.concatenate(part.indices)
    assert np.array_equal(np.sort(allidx), np.arange(part.n))


def test_layer_groups_by_name():
    assert layer_of("blocks.3.mlp.0.weight") == "blocks.3"
    assert layer_of("embed.weight") == "embed" and layer_of("pos") == "pos"


def test_contiguous_fragments_are_equal_consecutive_ranges():
    part = Fragments(LAYOUT, 4, "contiguous")
    _covers_once(part)
    assert part.n == N and max(part.sizes) - min(part.sizes) <= 1
    assert all(np.all(np.diff(ix) == 1) for ix in part.indices)
    assert part.indices[1][0] == N // 4


def test_strided_fragments_hold_every_fth_layer_group():
    part = Fragments(LAYOUT, 2, "strided")  # groups: embed, pos, blocks.0, blocks.1, ln
    _covers_once(part)
    b0 = 256 * 8 + 16 * 8
    assert part.indices[0][0] == 0 and b0 in set(part.indices[0].tolist())  # embed, blocks.0, ln
    assert 256 * 8 in set(part.indices[1].tolist())  # pos
    assert part.sizes[1] == 16 * 8 + 24 * 8 + 24
    with pytest.raises(InvalidArgument, match="^fragments: 6 strided fragments need at least 6 layer groups"):
        Fragments(LAYOUT, 6, "strided")
    with pytest.raises(InvalidArgument, match="^layout:"):
        Fragments(N, 2, "strided")
    with pytest.raises(InvalidArgument, match="^fragment_partition:"):
        Fragments(LAYOUT, 2, "random")


def test_take_and_put_touch_only_the_fragment():
    part = Fragments(LAYOUT, 3, "strided")
    x = np.arange(N, dtype=np.float32)
    y = part.put(x, 1, np.zeros(part.sizes[1], np.float32))
    assert np.all(y[part.indices[1]] == 0)
    others = np.setdiff1d(np.arange(N), part.indices[1])
    assert np.array_equal(y[others], x[others]) and x[5] == 5  # input untouched
    with pytest.raises(InvalidArgument, match="^values:"):
        part.put(x, 1, np.zeros(3, np.float32))
    with pytest.raises(InvalidArgument, match="^fragment:"):
        part.take(x, 3)


def test_staggered_schedule():
    assert [fragment_of(r, 4) for r in range(9)] == [0, 1, 2, 3, 0, 1, 2, 3, 0]
    assert fragment_of(7, 1) == 0


class _Flat(FlatStateWorkload):
    def __init__(self, cfg: RunConfig, params: np.ndarray, part: Fragments):
        self.cfg = cfg
        self.partition = part
        self.state = CommittedState(params, make_outer_for(cfg), 0)


def test_a_fragment_round_steps_only_its_fragment_and_the_state_round_trips_bit_for_bit():
    cfg = RunConfig(inner_steps=8, fragments=4)
    part = Fragments(LAYOUT, 4, "contiguous")
    rng = np.random.default_rng(0)
    wl = _Flat(cfg, rng.standard_normal(N).astype(np.float32), part)
    before = wl.state.params.copy()
    for r in range(6):
        f = wl.fragment()
        assert f == r % 4
        g = rng.standard_normal(part.sizes[f]).astype(np.float32)
        st = wl.tentative(g)
        assert st.fragment == f and st.rounds == r + 1
        changed = np.flatnonzero(st.params != wl.state.params)
        assert set(changed.tolist()) <= set(part.indices[f].tolist()) and changed.size > 0
        # The same fragment of a plain DiLoCo optimizer fed the same gradients gives the same bytes.
        wl.apply(st)
    with pytest.raises(InvalidArgument):
        wl.tentative(np.zeros(part.sizes[wl.fragment()] + 1, np.float32))
    blob = wl.state.to_bytes()
    back = CommittedState.from_bytes(blob, cfg)
    assert back.digest() == wl.state.digest() and back.fragment == -1
    st_a, st_b = wl.tentative(np.ones(part.sizes[2], np.float32)), None
    wl.state = back
    st_b = wl.tentative(np.ones(part.sizes[2], np.float32))
    assert st_a.digest() == st_b.digest()  # the restored per-fragment momenta step identically
    assert not np.array_equal(before, wl.state.params)


def test_fragmented_outer_matches_one_optimizer_per_fragment():
    outer = FragmentedOuter(DiLoCo, 2)
    ref = [DiLoCo(), DiLoCo()]
    rng = np.random.default_rng(1)
    p = [rng.standard_normal(5).astype(np.float32), rng.standard_normal(3).astype(np.float32)]
    for f in (0, 1, 0, 0, 1):
        g = rng.standard_normal(p[f].size).astype(np.float32)
        got = outer.step_fragment(f, p[f], g)
        want = ref[f].step(p[f], g)
        assert got.tobytes() == want.tobytes()
        p[f] = got
    state = outer.state()
    assert int(state["step"]) == 5 and int(state["0.step"]) == 3
    with pytest.raises(InvalidArgument, match="step_fragment"):
        outer.step(p[0], p[0])
    with pytest.raises(InvalidArgument, match="names no fragment"):
        outer.load_state({**state, "7.momentum": state["0.momentum"]})
    fresh = FragmentedOuter(DiLoCo, 2)
    fresh.load_state(state)
    assert all(np.array_equal(fresh.state()[k], v) for k, v in state.items())


@pytest.mark.parametrize("kwargs,field", [
    (dict(inner_steps=10, fragments=4), "fragments"),
    (dict(inner_steps=8, fragments=4, fragment_overlap=3), "fragment_overlap"),
    (dict(inner_steps=8, fragments=4, fragment_alpha=1.5), "fragment_alpha"),
    (dict(inner_steps=8, fragments=4, overlap=True), "overlap"),
    (dict(inner_steps=8, fragments=2, fragment_partition="x"), "fragment_partition"),
])
def test_run_config_refuses_bad_fragment_settings(kwargs, field):
    with pytest.raises(InvalidArgument, match=f"^{field}:"):
        RunConfig(**kwargs)


def test_engine_plans_carry_the_rounds_fragment_and_the_wire_keeps_it():
    eng = RoundEngine(EngineConfig(min_peers=2, collective="ring", fragments=4))
    for i, pid in enumerate(("a", "b")):
        eng.join(pid, b"k", f"127.0.0.1:{9000 + i}", 10, now=0.0)
    actions = []
    for pid in ("a", "b"):
        actions += eng.ready(pid, 0, ReadyInfo(100, pb.FLOAT32, 10, b"", 0, 0.0), now=0.1)
    plans = [a.plan for a in actions if isinstance(a, SendPlan)]
    assert plans and (plans[0].fragment, plans[0].fragments) == (0, 4)
    wire = Plan.from_proto(plans[0].to_proto())
    assert (wire.fragment, wire.fragments) == (0, 4)
    plain = Plan(participants=("a",), collective="ring", shard_bounds=(0, 1), shard_owner=(0,))
    assert Plan.from_proto(plain.to_proto()).fragments == 1


def test_peak_rate_over_a_sliding_window():
    assert peak_rate([]) == 0.0
    assert peak_rate([(0.0, 0.5, 1000.0)]) == pytest.approx(1000.0)  # all inside one window
    assert peak_rate([(0.0, 4.0, 4000.0)]) == pytest.approx(1000.0)  # spread: 1000 per second
    # Two bursts 0.8 s apart fit one window; 2 s apart they do not.
    assert peak_rate([(0.0, 0.1, 500.0), (0.8, 0.9, 500.0)]) == pytest.approx(1000.0)
    assert peak_rate([(0.0, 0.1, 500.0), (2.0, 2.1, 500.0)]) == pytest.approx(500.0)
    assert peak_rate([(1.0, 1.0, 300.0)]) == pytest.approx(300.0)


def test_traffic_counts_committed_rounds_per_fragment():
    def coll(r, a, f, t, n):
        return {"event": "collective", "round": r, "attempt": a, "fragment": f, "bytes_sent": n,
                "bytes_received": n, "started_at": t, "ended_at": t + 0.1}

    peer = [coll(0, 0, 0, 10.0, 100), {"event": "commit", "round": 0, "attempt": 0},
            coll(1, 0, 1, 20.0, 50), coll(1, 1, 1, 21.0, 60), {"event": "commit", "round": 1, "attempt": 1},
            coll(2, 0, 0, 30.0, 100), {"event": "commit", "round": 2, "attempt": 0}]
    out = traffic([peer, peer])
    assert out["rounds_per_fragment"] == {"0": 2, "1": 1}
    assert out["bytes_per_round_median"] == 200  # (200, 120, 200): both peers' committed attempts
    assert out["peak_bytes_per_s_per_peer"] == [100, 100] and out["peak_bytes_per_s"] == 100


def test_a_fragmented_state_checkpoints_and_verifies(tmp_path):
    """The per-fragment outer state goes through a checkpoint and back to the same digest."""
    from shoal.peer.checkpoints import verify, write_checkpoint

    cfg = RunConfig(inner_steps=8, fragments=4)
    part = Fragments(LAYOUT, 4, "contiguous")
    wl = _Flat(cfg, np.random.default_rng(2).standard_normal(N).astype(np.float32), part)
    for _ in range(5):
        wl.apply(wl.tentative(np.full(part.sizes[wl.fragment()], 0.1, np.float32)))
    ckpt = write_checkpoint(tmp_path, wl.state, cfg, LAYOUT)
    assert verify(ckpt).digest() == wl.state.digest()
