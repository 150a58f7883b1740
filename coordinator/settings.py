"""The round settings: quorum, timing, chunking and cohorts of the coordinator's rounds.

Responsible for declaring each setting of the `[rounds]` configuration table once: its name, type,
default and meaning. `shoal.config.RoundsSection` is this dataclass (plus validation), the engine's
`shoal.coordinator.rounds.EngineConfig` extends it, and the planner's
`shoal.coordinator.planner.PlanPolicy` takes its defaults from it, so a setting read from a file, the
environment or a flag reaches the engine and the planner under the same name. Pure: no I/O.
Not responsible for checking ranges (`shoal.config`) or for what the settings do (the engine).
"""

from __future__ import annotations

from dataclasses import dataclass

from shoal.common.settings import setting


@dataclass(frozen=True)
class RoundSettings:
    """[rounds]: quorum and timing of rounds, decided by the coordinator."""

    rounds: int = setting(20, "committed rounds to run, then finish: peers are told and leave, the coordinator "
                              "exits 0 (0 = run forever)")
    min_peers: int = setting(2, "quorum: fewest participants of a round")
    initial_peers: int = setting(0, "round 0 waits for this many ready peers (0 = min_peers)")
    lease_seconds: float = setting(10.0, "a peer silent (no heartbeat) this long is dropped; heartbeats every lease/4")
    ready_timeout: float = setting(5.0, "after the first ready of a round, wait at most this long for the other "
                                        "members (stragglers), then open the round with those ready")
    collective_timeout: float = setting(30.0, "least deadline of one collective attempt, plan to last vote (longer "
                                              "on slow links: chunk_safety * expected time + one chunk deadline)")
    chunk_timeout: float = setting(2.0, "floor of the per-chunk deadline: max(this, chunk_safety * chunk_bytes / "
                                        "slowest link + 2 * max RTT + expected collective time), an unreported link "
                                        "counting as 4 Mbit/s (detects a silent peer)")
    chunk_safety: float = setting(4.0, "safety factor of the per-chunk deadline over the measured transfer time")
    chunk_bytes: int = setting(1 << 20, "largest tensor chunk through sockets, bytes (the planner sends ~0.15 s "
                                        "of the slowest measured link per chunk)")
    shm_chunk_bytes: int = setting(4 << 20, "tensor chunk when all participants reach each other through shared "
                                            "memory (one host), bytes")
    bulk_chunk_bytes: int = setting(4 << 20, "largest tensor chunk when all participants reach each other through "
                                             "the bulk TCP lane or shared memory, bytes (in place of chunk_bytes)")
    collective: str = setting("auto", "collective algorithm of the all-reduce (auto: chosen by the planner from the "
                                      "peers' measured links; butterfly with equal tensor shards until links are "
                                      "known; sparse_rs: with run.compression topk or dct, the sparse reduce-scatter "
                                      "whenever it can be planned, else as auto)",
                              choices=("ring", "butterfly", "auto", "sparse_rs"))
    cohort_size: int = setting(0, "participants per round: a cohort drawn uniformly at random (seeded by run.seed) "
                                  "from the ready peers, also the fewest ready peers a round opens with; only "
                                  "drawn peers fetch the committed state, the others keep theirs until drawn "
                                  "(0 = every ready peer)")
    cohort_timeout: float = setting(60.0, "a drawn peer holding an older state has this long to fetch the committed "
                                          "state, train and say ready, then its place is drawn again (seconds)")
    sync_hold: float = setting(60.0, "longest a round waits for a joiner (or a peer that fell behind) downloading "
                                     "the committed state, seconds; the wait is 1.5x its expected download time "
                                     "when its rate is known, and ends when it says ready")
    checkpointers: int = setting(1, "participants each commit elects to upload the checkpoint to the peers' shared "
                                    "checkpoint store (checkpoint_url) when one is due: those with the best measured "
                                    "upload (0 = every participant)")
    max_attempts: int = setting(5, "attempts of one round (first try + retries) before it is given up")
    retry_backoff: float = setting(0.05, "retry k of a round is planned after retry_backoff * 2**(k-1) seconds")
    relay_backoff: float = setting(1.0, "after an abort blamed on a relay (down, or a chunk altered on it), the retry "
                                        "waits at least this long (seconds): a relay coming back, or its peers moving "
                                        "to another relay, takes seconds, not milliseconds")
    blame_window: float = setting(3.0, "after a failed vote that accuses other peers, wait this long (at least "
                                       "twice the chunk deadline) for every participant's vote before choosing whom "
                                       "to exclude (silent peers first; docs/fault-tolerance.md)")


DEFAULTS = RoundSettings()
