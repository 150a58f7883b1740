"""Malicious contributions, for testing robust aggregation (`shoal peer --attack NAME`).

A Byzantine peer plays the protocol normally (joins, votes) but sends a forged pseudo-gradient
in place of its real one, or, with "owner", sends its real one and corrupts the aggregate of the
shards it owns before publishing it (the attack `--audit-owners` catches; docs/aggregation.md).
The "false-blame" and "lying-digest" attacks forge the vote instead (`forge_ballot`), the lies
the coordinator's blame must not believe (coordinator.blame, "Evidence"). The honest peers are
not told which peers attack. This module is pure: values in, forged out.

| attack      | what is sent                                                              |
| ----------- | ------------------------------------------------------------------------- |
| "sign-flip" | `-scale * x` (scale defaults to 4): pushes the model uphill               |
| "scale"     | `scale * x` (scale defaults to 50): a huge step in the honest direction  |
| "nan"       | all NaN: must be dropped by validation, never reach a model               |
| "random"    | Gaussian noise with `scale` times the honest norm (scale defaults to 10) |
| "owner"     | honest contribution; as a shard owner it publishes `-scale * aggregate` (scale 10) |
| "false-blame"  | honest contribution; after a collective that succeeded it votes failed, naming an honest participant |
| "lying-digest" | honest contribution; it votes ok with a random result digest |

Not modelled: colluding attackers that adapt to the aggregator (e.g. "a little is enough"); see
docs/aggregation.md.
"""

from __future__ import annotations

import numpy as np

from shoal.common.errors import InvalidArgument
from shoal.common.plan import Plan
from shoal.v1 import shoal_pb2 as pb

ATTACKS = ("sign-flip", "scale", "nan", "random")  # forged contributions
OWNER_ATTACKS = ("owner",)  # corrupted aggregates, published by a shard owner
VOTE_ATTACKS = ("false-blame", "lying-digest")  # forged votes, after an honest collective
DEFAULT_SCALE = {"sign-flip": 4.0, "scale": 50.0, "nan": 1.0, "random": 10.0, "owner": 10.0}


def forge(attack: str, x: np.ndarray, rng: np.random.Generator, scale: float | None = None) -> np.ndarray:
    """The forged `(n,)` float32 contribution replacing the honest `x` `(n,)` float32.

    Raises InvalidArgument for an unknown attack name.
    """
    if attack not in ATTACKS:
        raise InvalidArgument(f"attack: unknown {attack!r}; expected one of {list(ATTACKS)}")
    s = np.float32(DEFAULT_SCALE[attack] if scale is None else scale)
    if attack == "sign-flip":
        return (-s * x).astype(np.float32)
    if attack == "scale":
        return (s * x).astype(np.float32)
    if attack == "nan":
        return np.full_like(x, np.nan, dtype=np.float32)
    norm = float(np.linalg.norm(x.astype(np.float64))) or 1.0
    noise = rng.standard_normal(x.shape[0])
    return (noise * (s * norm / np.sqrt(max(1, x.shape[0])))).astype(np.float32)


def tamper(values: np.ndarray, scale: float | None = None) -> np.ndarray:
    """The "owner" attack: the `(m,)` aggregate a malicious owner publishes instead of `values`."""
    s = np.float32(DEFAULT_SCALE["owner"] if scale is None else scale)
    return (-s * values).astype(values.dtype)


def forge_ballot(attack: str, ballot: pb.VoteRequest, plan: Plan, rng: np.random.Generator) -> None:
    """Forge `ballot` (this peer's vote on `plan`) in place as the vote attack `attack` says; a
    ballot that failed honestly is left alone (the lie is about a collective that succeeded).

    Raises InvalidArgument for a name not in VOTE_ATTACKS.
    """
    if attack not in VOTE_ATTACKS:
        raise InvalidArgument(f"attack: unknown vote attack {attack!r}; expected one of {list(VOTE_ATTACKS)}")
    if not ballot.ok:
        return
    if attack == "lying-digest":
        ballot.result_digest = rng.bytes(32)
        return
    victim = next((p for p in plan.participants if p != ballot.peer_id), "")
    if not victim:
        return
    ballot.ok = False
    ballot.result_digest, ballot.state_digest = b"", b""
    ballot.error = f"no chunk from {victim[:8]} (forged)"
    del ballot.suspects[:]
    ballot.suspects.append(victim)
