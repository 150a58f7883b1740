"""Secure aggregation (SecAgg+, peer.secagg) as a pure protocol: fixed point, graph, Shamir,
masking, unmasking with dropouts after and before sending, abort below the threshold, and what one
participant's view leaks (nothing without t shares; everything with t colluding neighbours)."""

from __future__ import annotations

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from kits.uniformity import assert_bytes_uniform, assert_top_bits_uniform
from shoal.common.errors import InvalidArgument
from shoal.peer.secagg import (
    SecAggAbort, SecAggParams, SecAggParticipant, dequantize, neighbour_graph, pairwise_mask, pairwise_seed, prg,
    quantize, shamir_combine, shamir_split, unmask, unmaskable,
)

CTX = b"run|round 3|attempt 0"


def test_fixed_point_round_trips_and_sums_exactly_in_the_ring():
    params = SecAggParams(clip=4.0, frac_bits=16)
    x = np.array([0.0, 1.5, -1.5, 3.99, -4.0, 1e-6, 100.0], dtype=np.float32)
    q = quantize(x, params)
    assert q.dtype == np.uint32
    back = dequantize(q, params)
    assert np.allclose(back[:6], x[:6], atol=2 ** -17) and back[6] == 4.0  # clipped to ±clip
    rows = [quantize(np.full(3, v, np.float32), params) for v in (-3.0, 2.25, -1.0)]
    total = rows[0] + rows[1] + rows[2]  # uint32 wraps: the sum mod 2^32
    assert np.array_equal(dequantize(total, params), np.full(3, -1.75, np.float32))
    with pytest.raises(InvalidArgument, match="non-finite"):
        quantize(np.array([np.nan]), params)


def test_parameters_that_overflow_the_ring_or_lack_shares_are_refused():
    with pytest.raises(InvalidArgument, match="clip"):
        SecAggParams(clip=1024.0, frac_bits=16).check(64)
    with pytest.raises(InvalidArgument, match="threshold"):
        SecAggParams(degree=4, threshold=5).check(10)
    with pytest.raises(InvalidArgument, match="degree"):
        SecAggParams(degree=3, threshold=2).check(10)


@pytest.mark.parametrize("p,k", [(6, 4), (16, 4), (16, 6), (5, 8)])
def test_neighbour_graph_is_symmetric_k_regular_and_seeded(p, k):
    params = SecAggParams(degree=k, threshold=2)
    g = neighbour_graph(p, params, b"seed-a")
    deg = min(k, p - 1)
    for v, near in enumerate(g):
        assert len(near) == deg and v not in near
        assert all(v in g[u] for u in near)
    assert neighbour_graph(p, params, b"seed-a") == g
    if deg < p - 1:
        assert neighbour_graph(p, params, b"seed-b") != g


def test_shamir_t_shares_reconstruct_and_t_minus_1_do_not():
    secret = bytes(range(32))
    shares = shamir_split(secret, [1, 2, 3, 4, 5], threshold=3)
    assert shamir_combine({x: shares[x] for x in (1, 3, 5)}, 3) == secret
    assert shamir_combine({x: shares[x] for x in (2, 4, 5)}, 3) == secret
    assert shamir_combine({x: shares[x] for x in (1, 2)}, 2) != secret  # treated as 2-of: wrong
    with pytest.raises(SecAggAbort):
        shamir_combine({x: shares[x] for x in (1, 2)}, 3)


def make_round(p, params, seed=b"graph"):
    graph = neighbour_graph(p, params, seed)
    parts = [SecAggParticipant(i, graph, params, CTX) for i in range(p)]
    keys = {i: parts[i].public_key for i in range(p)}
    for a in parts:
        for j, share in a.shares().items():
            parts[j].receive(share)
    return graph, parts, keys


def inputs(p, n, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.normal(0, 0.5, n).astype(np.float32) for _ in range(p)]


def run(p, params, xs, *, sent, survivors):
    """Mask, sum the senders' rows mod 2^32, reveal from the survivors, unmask."""
    graph, parts, keys = make_round(p, params)
    rows = {i: parts[i].mask(xs[i], {j: keys[j] for j in parts[i].neighbours}) for i in sent}
    total = np.zeros(xs[0].shape, np.uint32)
    for i in sorted(rows):
        total += rows[i]
    revealed = {i: parts[i].reveal(sent) for i in survivors}
    return unmask(total, sent, revealed, keys, graph, params, CTX)


def plain_sum(xs, who, params):
    """The survivors' plain sum in the same fixed point: the exact value secure aggregation must give."""
    total = np.zeros(xs[0].shape, np.uint32)
    for i in sorted(who):
        total += quantize(xs[i], params)
    return dequantize(total, params)


@pytest.mark.parametrize("p", [6, 16])
def test_no_dropout_gives_the_exact_sum(p):
    params = SecAggParams(degree=4, threshold=3)
    xs = inputs(p, 1000)
    got = run(p, params, xs, sent=range(p), survivors=range(p))
    assert np.array_equal(got, plain_sum(xs, range(p), params))  # bit-identical, not approximately
    assert np.allclose(got, np.sum(xs, axis=0), atol=p * 2 ** -17)


def test_a_participant_dropping_after_sending_is_unmasked_by_the_survivors_shares():
    params = SecAggParams(degree=4, threshold=3)
    xs = inputs(6, 500, seed=1)
    got = run(6, params, xs, sent=range(6), survivors=[0, 1, 3, 4, 5])  # 2 sent, then died
    assert np.array_equal(got, plain_sum(xs, range(6), params))


def test_a_participant_dropping_before_sending_is_removed_by_reconstructing_its_mask_key():
    params = SecAggParams(degree=4, threshold=3)
    xs = inputs(6, 500, seed=2)
    alive = [0, 1, 2, 3, 5]  # 4 handed out its shares, then died before sending
    got = run(6, params, xs, sent=alive, survivors=alive)
    assert np.array_equal(got, plain_sum(xs, alive, params))


def test_one_drop_after_and_one_before_sending_in_the_same_round():
    params = SecAggParams(degree=6, threshold=3)
    xs = inputs(16, 300, seed=3)
    sent = [i for i in range(16) if i != 7]
    survivors = [i for i in sent if i != 11]
    got = run(16, params, xs, sent=sent, survivors=survivors)
    assert np.array_equal(got, plain_sum(xs, sent, params))


def test_fewer_than_t_shares_abort_the_round():
    params = SecAggParams(degree=4, threshold=3)
    xs = inputs(6, 50, seed=4)
    graph = neighbour_graph(6, params, b"graph")
    # Keep alive only one neighbour of participant 0: fewer than t shares of its seed remain.
    survivors = [i for i in range(6) if i not in graph[0][1:]]
    with pytest.raises(SecAggAbort, match="participant"):
        run(6, params, xs, sent=range(6), survivors=survivors)
    with pytest.raises(SecAggAbort, match="survivors"):
        run(6, params, xs, sent=range(6), survivors=[0, 1])


def test_unmaskable_says_exactly_when_unmask_has_enough_reveals():
    """What a survivor waits for before unmasking (peer.secure_round): every subset of survivors
    that `unmaskable` accepts unmasks, every one it refuses aborts."""
    params = SecAggParams(degree=4, threshold=3)
    xs = inputs(6, 50, seed=5)
    graph, parts, keys = make_round(6, params)
    for sent in (range(6), [0, 1, 2, 3, 5]):
        rows = [parts[i].mask(xs[i], {j: keys[j] for j in parts[i].neighbours}) for i in sent]
        total = np.sum(rows, axis=0, dtype=np.uint32)
        for bits in range(1 << 6):
            survivors = [i for i in sent if bits >> i & 1]
            revealed = {i: parts[i].reveal(sent) for i in survivors}
            if unmaskable(sent, revealed, graph, params):
                assert np.array_equal(unmask(total, sent, revealed, keys, graph, params, CTX),
                                      plain_sum(xs, sent, params))
            else:
                with pytest.raises(SecAggAbort):
                    unmask(total, sent, revealed, keys, graph, params, CTX)


def test_a_lying_survivor_s_key_share_is_detected():
    params = SecAggParams(degree=4, threshold=3)
    xs = inputs(6, 50, seed=5)
    graph, parts, keys = make_round(6, params)
    sent = [0, 1, 2, 3, 5]
    total = np.zeros(50, np.uint32)
    for i in sent:
        total += parts[i].mask(xs[i], keys)
    revealed = {i: parts[i].reveal(sent) for i in sent}
    liar = next(h for h in sent if 4 in revealed[h])
    revealed[liar] = {**revealed[liar], 4: ("key", revealed[liar][4][1] + 1)}
    with pytest.raises(InvalidArgument, match="public key"):
        unmask(total, sent, {h: revealed[h] for h in [liar] + [h for h in sent if h != liar]}, keys, graph, params,
               CTX)


def test_what_one_participant_receives_reveals_no_other_contribution_but_t_colluders_recover_it():
    """The view of participant 0 acting as the reducer: every masked row, every public key, the
    graph, and the one share of each neighbour's seed and key it holds (the coordinator sees only
    public keys and the graph seed, a subset). A victim's masked row is uniform on Z_2^32 even
    for a constant input (chi-square over its bytes and its top 8 bits), it is uncorrelated with
    the input, and fewer than t shares reconstruct a wrong seed; t colluding neighbours of the
    victim reconstruct its seed and key and recover its contribution exactly."""
    params = SecAggParams(degree=4, threshold=3)
    p, n = 6, 40_000
    graph, parts, keys = make_round(p, params)
    victim = next(v for v in range(1, p) if 0 not in graph[v])  # 0 holds no share of the victim
    x = np.full(n, 1.25, dtype=np.float32)  # the most structured input there is
    row = parts[victim].mask(x, keys)
    assert victim not in parts[0].held
    assert_bytes_uniform(row)
    assert_top_bits_uniform(row)
    ramp = np.linspace(-2, 2, n).astype(np.float32)
    assert abs(np.corrcoef(parts[victim].mask(ramp, keys).astype(np.float64), ramp)[0, 1]) < 0.03

    colluders = list(graph[victim])[:params.threshold]
    seed_shares = {h + 1: parts[h].held[victim].seed_share for h in colluders}
    key_shares = {h + 1: parts[h].held[victim].key_share for h in colluders}

    def recover(seed: bytes, key: bytes) -> np.ndarray:
        sk = X25519PrivateKey.from_private_bytes(key)
        y = row - prg(seed, n)
        for j in graph[victim]:
            y -= pairwise_mask(victim, j, pairwise_seed(sk, keys[j], CTX), n)
        return dequantize(y, params)

    assert np.array_equal(recover(shamir_combine(seed_shares, 3), shamir_combine(key_shares, 3)), x)
    short = dict(list(seed_shares.items())[:2])
    short_keys = dict(list(key_shares.items())[:2])
    guess = recover(shamir_combine(short, 2), shamir_combine(short_keys, 2))  # t - 1 colluders
    assert not np.allclose(guess, x, atol=1.0)
