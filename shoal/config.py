"""Configuration of every `shoal` command: one tree of frozen dataclasses, four layers.

Responsible for: the settings of `shoal coordinator`, `shoal peer`, `shoal swarm` and
`shoal status`, their defaults, types and meaning (the single source docs/configuration.md is
generated from; the [rounds] table is `shoal.coordinator.settings.RoundSettings`, declared next
to the engine that reads it), and merging the layers in this order, each overriding the previous one:

    built-in defaults  <  TOML file (--config)  <  environment (SHOAL_<SECTION>_<KEY>)  <  flags

A key `inner_steps` of table `[run]` is the environment variable `SHOAL_RUN_INNER_STEPS` and the
flag `--inner-steps`. Booleans in the environment accept 1/0, true/false, yes/no, on/off.
Unknown keys, wrong types and unparsable values raise `ConfigError` (exit code 2); nothing is
silently ignored.

Not responsible for: what the settings do (the coordinator, peer and swarm modules), or the
run's training configuration as the peers receive it (peer.training.RunConfig, built from the
`[run]` section by `RunSection.to_run_config`).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import ipaddress
import logging
import os
import tomllib
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from shoal.common.attempts import ATTEMPT_STRIDE
from shoal.common.limits import MAX_BULK_CHUNK_BYTES
from shoal.common.privacy import DpSettings
from shoal.common.settings import setting
from shoal.peer.secagg import SecAggParams, refused_with
from shoal.coordinator.rounds import SECURE_MIN_PEERS, EngineConfig
from shoal.coordinator.settings import RoundSettings

log = logging.getLogger("shoal.config")

ENV_PREFIX = "SHOAL_"
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


class ConfigError(ValueError):
    """A setting is unknown, has the wrong type, cannot be parsed, or is out of range (exit code 2).

    `setting` is "section.key" when the error is about one setting's value (set by `validate`),
    so `load` can name the layer (flag, environment variable or file) it came from."""

    def __init__(self, message: str, setting: str | None = None):
        super().__init__(message)
        self.setting = setting


def _check(ok: bool, section: str, key: str, rule: str, value: Any) -> None:
    """Raise ConfigError "must be <rule>, got <value>" for `section.key` unless `ok`."""
    if not ok:
        raise ConfigError(f"must be {rule}, got {value!r}", setting=f"{section}.{key}")


def _plain_host(text: str) -> bool:
    """A host name or an IP literal (no port, no spaces): what a relay advertises."""
    try:
        ipaddress.ip_address(text.strip("[]"))
        return True
    except ValueError:
        pass
    labels = text.rstrip(".").split(".")
    return bool(text) and len(text) <= 253 and all(
        0 < len(label) <= 63 and label.replace("-", "").isalnum() and label.isascii() for label in labels)


def _finite(x: float) -> bool:
    return x == x and x not in (float("inf"), float("-inf"))


def grpc_target(addresses: str) -> str:
    """A gRPC channel target for `addresses`: one HOST:PORT as it is; several IP:PORT (comma
    separated) as an `ipv4:` / `ipv6:` target, whose pick-first policy connects to the first
    address that accepts (standby coordinators bind no port: the leader) and moves on when that
    connection breaks. Raises ConfigError when a list holds a host name."""
    parts = [a.strip() for a in addresses.split(",") if a.strip()]
    if len(parts) <= 1:
        return addresses
    family = None
    for a in parts:
        host = a.rsplit(":", 1)[0].strip("[]")
        try:
            version = ipaddress.ip_address(host).version
        except ValueError:
            raise ConfigError(f"{a}: a list of coordinators takes IP:PORT addresses (or give one DNS name with "
                              f"several records)") from None
        if family not in (None, version):
            raise ConfigError(f"{addresses}: IPv4 and IPv6 coordinators cannot be mixed in one list")
        family = version
    return f"ipv{family}:{','.join(parts)}"


def check_address(section: str, key: str, value: str, *, port_zero: bool = True) -> None:
    """HOST:PORT with a non-empty host and a port in 0..65535 (1..65535 without `port_zero`)."""
    host, sep, port = value.rpartition(":")
    lo = 0 if port_zero else 1
    rule = f"HOST:PORT with PORT in {lo}..65535"
    _check(bool(sep) and bool(host) and port.isdigit() and lo <= int(port) <= 65535, section, key, rule, value)


# ---------------------------------------------------------------------------------- sections


@dataclass(frozen=True)
class LogSection:
    """[log]: logging of every command."""

    level: str = setting("info", "log level", flag="--log-level", choices=("debug", "info", "warning", "error"))
    format: str = setting("text", "log record format: text, or one JSON object per line", flag="--log-format",
                          choices=("text", "json"))

    def validate(self) -> None:
        """Choices are checked on load; nothing else to check."""


@dataclass(frozen=True)
class CoordinatorSection:
    """[coordinator]: the control-plane daemon (`shoal coordinator`)."""

    listen: str = setting("127.0.0.1:7070", "HOST:PORT to serve gRPC on (port 0 = any free port)")
    state: str = setting("shoal-coordinator.db", "SQLite state file (members, epochs, commits), reloaded on restart; "
                                                 "or etcd://HOST:PORT[,HOST:PORT...]/PREFIX: the state in etcd, shared "
                                                 "by standby coordinators (one leads; docs/deploy.md)")
    key: str | None = setting(None, "Ed25519 key file that signs round tickets (default: the state file with .key)")
    resume_from: str | None = setting(None, "with a new state file: start the run at the newest checkpoint in this "
                                            "directory (a peer's checkpoint_dir, or file://DIR) that passes its digest "
                                            "check: its round, state digest and run configuration; peers resume from "
                                            "their copies of it (docs/checkpoints.md)")
    ready_file: str | None = setting(None, "write the bound address to this file once serving")
    metrics_port: int = setting(0, "serve Prometheus /metrics on this port (0 = off)")
    metrics_host: str = setting("0.0.0.0", "address the /metrics server binds")
    num_data_shards: int = setting(4, "data shards: parts the default workload's training data is cut into")
    tls_dir: str | None = setting(None, "TLS directory made by `shoal certs init` (ca.pem, coordinator.*; with ca.key "
                                        "the coordinator issues each peer its data-plane certificate at join)")
    mtls: bool = setting(False, "mutual TLS on the control plane: demand a client certificate signed by ca.pem; "
                                "applied only with a legacy directory holding a shared peer.key (peers get their "
                                "certificate at join, every call is signed)")
    cert_lifetime: float = setting(86400.0, "seconds a peer's data-plane certificate issued at join is valid (renewed "
                                            "after two thirds of it)")
    insecure: bool = setting(False, "plaintext gRPC (logs a warning); required when there is no tls_dir")
    join_token_secret: str | None = setting(None, "admit only peers with a join token made from this secret file "
                                                  "(`shoal token create`)")
    allow_list: str | None = setting(None, "admit only these Ed25519 public keys (hex, one a line)")
    join_rate: float = setting(5.0, "joins per second per host (token bucket)")
    join_burst: int = setting(50, "join burst per host")
    rate_limit: float = setting(500.0, "control-plane calls per second per host (burst 2x)")
    finish_linger: float = setting(10.0, "once the run finished (rounds.rounds committed) and every member left: "
                                         "keep answering `shoal status` this long, then exit 0")
    history_window: int = setting(EngineConfig.history_window, "committed rounds and aborted attempts kept in memory (the state file keeps "
                                       "all of them; `shoal status --recent N` reads older ones from it)")
    reach_timeout: float = setting(2.0, "dial a joiner's advertised data address back within this many seconds "
                                        "(nonce challenge; once more after a timeout); a peer that does not answer "
                                        "takes part outbound-only (0 = do not check)")
    member_retention: float = setting(7 * 86400.0, "seconds an admitted key (a member) stays admitted unused: it "
                                                   "rejoins without a join token until revoked (`shoal member "
                                                   "revoke`) or unused this long")
    trace_dir: str | None = setting(None, "write loop.csv here: per second, the event loop's lag, garbage-collector "
                                          "pauses, and each call's wait in gRPC core and time in its handler "
                                          "(docs/performance.md, \"Coordinator scale\")")
    accept_loops: int = setting(4, "gRPC servers sharing the listen port (SO_REUSEPORT), each taking calls from gRPC "
                                   "core one at a time: a burst of calls waits less (docs/performance.md, "
                                   "\"Coordinator scale\")")
    store_unreachable_limit: float = setting(600.0, "with --state etcd://: seconds the etcd store may stay "
                                                    "unreachable (the coordinator steps down, retries with backoff, "
                                                    "campaigns again) before the process ends with a line naming "
                                                    "this setting (0 = never)")
    etcd_ca: str | None = setting(None, "with --state etcd://: the CA (PEM) that signed etcd's server certificate: "
                                        "TLS to etcd (https client URLs); unset = plaintext")
    etcd_cert: str | None = setting(None, "with etcd_ca: this coordinator's client certificate (PEM) for etcd's "
                                          "--client-cert-auth")
    etcd_key: str | None = setting(None, "with etcd_cert: its private key (PEM)")
    etcd_user: str = setting("", "with --state etcd://: the etcd user (etcd's authentication); empty = none")
    etcd_password: str = setting("", "the etcd user's password (better in $SHOAL_COORDINATOR_ETCD_PASSWORD than "
                                     "on the command line)")

    def validate(self) -> None:
        """Raise ConfigError naming the first out-of-range setting."""
        c = "coordinator"
        _check((self.etcd_cert is None) == (self.etcd_key is None), c, "etcd_cert",
               "given together with etcd_key", self.etcd_cert)
        _check(self.etcd_cert is None or self.etcd_ca is not None, c, "etcd_cert", "given with etcd_ca (TLS)",
               self.etcd_cert)
        _check(bool(self.etcd_user) or not self.etcd_password, c, "etcd_password", "given with etcd_user", "***")
        _check(self.store_unreachable_limit >= 0 and _finite(self.store_unreachable_limit), c,
               "store_unreachable_limit", ">= 0", self.store_unreachable_limit)
        _check(1 <= self.accept_loops <= 64, c, "accept_loops", "in 1..64", self.accept_loops)
        _check(self.history_window >= 1, c, "history_window", ">= 1", self.history_window)
        _check(self.reach_timeout >= 0 and _finite(self.reach_timeout), c, "reach_timeout", ">= 0", self.reach_timeout)
        check_address(c, "listen", self.listen)
        _check(bool(self.state), c, "state", "a file path", self.state)
        _check(0 <= self.metrics_port <= 65535, c, "metrics_port", "in 0..65535", self.metrics_port)
        _check(self.num_data_shards >= 1, c, "num_data_shards", ">= 1", self.num_data_shards)
        _check(self.join_rate > 0 and _finite(self.join_rate), c, "join_rate", "> 0", self.join_rate)
        _check(self.join_burst >= 1, c, "join_burst", ">= 1", self.join_burst)
        _check(self.cert_lifetime >= 10 and _finite(self.cert_lifetime), c, "cert_lifetime", ">= 10",
               self.cert_lifetime)
        _check(self.rate_limit > 0 and _finite(self.rate_limit), c, "rate_limit", "> 0", self.rate_limit)
        _check(self.finish_linger >= 0 and _finite(self.finish_linger), c, "finish_linger", ">= 0",
               self.finish_linger)
        _check(self.member_retention > 0 and _finite(self.member_retention), c, "member_retention", "> 0",
               self.member_retention)


@dataclass(frozen=True)
class RoundsSection(RoundSettings):  # the settings: shoal.coordinator.settings, next to the engine
    """[rounds]: quorum and timing of rounds, decided by the coordinator."""

    def validate(self) -> None:
        """Raise ConfigError naming the first out-of-range setting."""
        r = "rounds"
        _check(self.rounds >= 0, r, "rounds", ">= 0 (0 = run forever)", self.rounds)
        _check(self.min_peers >= 1, r, "min_peers", ">= 1", self.min_peers)
        _check(self.initial_peers >= 0, r, "initial_peers", ">= 0 (0 = min_peers)", self.initial_peers)
        for key in ("lease_seconds", "collective_timeout", "chunk_timeout", "chunk_safety", "cohort_timeout",
                    "sync_hold"):
            v = getattr(self, key)
            _check(v > 0 and _finite(v), r, key, "> 0", v)
        for key in ("ready_timeout", "retry_backoff", "blame_window"):
            v = getattr(self, key)
            _check(v >= 0 and _finite(v), r, key, ">= 0", v)
        _check(self.chunk_bytes >= 1024, r, "chunk_bytes", ">= 1024", self.chunk_bytes)
        _check(1024 <= self.shm_chunk_bytes <= 256 << 20, r, "shm_chunk_bytes", "in 1024..268435456",
               self.shm_chunk_bytes)
        # A chunk planned for the bulk lane may still cross gRPC (a lane that failed: the fallback).
        _check(1024 <= self.bulk_chunk_bytes <= MAX_BULK_CHUNK_BYTES, r, "bulk_chunk_bytes",
               f"in 1024..{MAX_BULK_CHUNK_BYTES}", self.bulk_chunk_bytes)
        _check(1 <= self.max_attempts < ATTEMPT_STRIDE, r, "max_attempts", f"in 1..{ATTEMPT_STRIDE - 1}",
               self.max_attempts)
        _check(self.cohort_size >= 0, r, "cohort_size", ">= 0 (0 = every ready peer)", self.cohort_size)

    def to_engine_config(self, run: RunSection | None = None) -> EngineConfig:
        """The engine's settings: every [rounds] setting as it is, and from `run` the aggregator
        and codec the plans carry and the seed of the cohort draws."""
        run = run or RunSection()
        collective = "butterfly" if run.needs_butterfly() else self.collective
        return EngineConfig.from_settings(self, collective=collective, aggregator=run.aggregator,
                                          compression=run.compression, audit_owners=run.audit_owners,
                                          cohort_seed=run.seed, privacy=run.dp_settings(),
                                          fragments=run.fragments, secure_aggregation=run.secure_aggregation,
                                          sparse_bytes_per_element=run.sparse_bytes_per_element(),
                                          sparse_chunk=run.sparse_chunk if run.compression in ("topk", "dct") else 0)


@dataclass(frozen=True)
class RunSection:
    """[run]: the training run, set on the coordinator and handed to every peer at join."""

    algorithm: str = setting("diloco", "training algorithm: diloco (H inner steps + Nesterov outer step) or fedavg "
                                       "(weighted mean)",
                             choices=("diloco", "fedavg"))
    seed: int = setting(0, "seed of the data split, the initial parameters and the inner batches")
    inner_steps: int = setting(50, "local optimizer steps per round (H)")
    batch_size: int = setting(32, "inner minibatch size (workload lm: 16 unless set)")
    lr: float = setting(3e-3, "inner Adam learning rate (workload lm: AdamW 2e-3 unless set)")
    hidden: int = setting(64, "hidden units of the default MLP")
    outer: str = setting("", "outer optimizer (empty = by algorithm: diloco -> nesterov, fedavg -> sgd lr 1)")
    non_iid: bool = setting(False, "label-skewed data split across peers")
    fedprox_mu: float = setting(0.0, "FedProx proximal term weight (0 = off)")
    aggregator: str = setting("mean", "what shard owners compute (docs/aggregation.md); anything but mean runs on "
                                      "the butterfly collective",
                              choices=("mean", "median", "trimmed-mean", "centered-clip", "krum",
                                       "multi-krum", "bulyan"))
    trim_beta: float | None = setting(None, "trimmed-mean: fraction trimmed from each side (default 0.2)")
    krum_f: int | None = setting(None, "krum / multi-krum / bulyan: Byzantine peers tolerated (default 1)")
    krum_m: int | None = setting(None, "multi-krum: rows averaged (default n - f)")
    clip_tau: float | None = setting(None, "centered-clip: clipping radius (default 1.0)")
    clip_iters: int | None = setting(None, "centered-clip: iterations (default 5)")
    max_norm: float = setting(0.0, "L2 bound on each contribution, applied by the shard owners (0 = none)")
    on_norm: str = setting("clip", "what happens to a contribution beyond max_norm", choices=("clip", "reject"))
    dp_sigma: float = setting(0.0, "DP noise multiplier sigma of the Gaussian mechanism on the mean of the "
                                   "contributions clipped to max_norm (needs max_norm; docs/aggregation.md)")
    dp_mode: str = setting("owner", "who adds the DP noise: owner (each shard owner adds N(0, (sigma * max_norm / "
                                    "p)^2) once), distributed (each participant clips its contribution and adds "
                                    "its share N(0, sigma^2 max_norm^2 / p)), local (each participant adds "
                                    "N(0, (sigma * max_norm)^2))", choices=("owner", "distributed", "local"))
    dp_delta: float = setting(1e-5, "delta of the (epsilon, delta) the accountant reports after every committed "
                                    "round")
    dp_epsilon_budget: float = setting(0.0, "epsilon budget of the run (0 = none): no round opens that would "
                                            "spend more (or only a warning, with dp_on_budget = warn)")
    dp_on_budget: str = setting("stop", "what happens when the next round would spend more than "
                                        "dp_epsilon_budget: stop the run, or warn in the log and go on",
                                choices=("stop", "warn"))
    outer_lr: float | None = setting(None, "outer learning rate (default per outer optimizer)")
    outer_params: str = setting("", "other outer optimizer parameters, KEY=VALUE[,KEY=VALUE] (momentum, beta1, "
                                    "beta2, tau)")
    compression: str = setting("none", "wire codec: per hop (fp16, bf16, int8: blockwise absmax; fp4: 4-bit float "
                                       "E2M1 with a float32 scale per 256 elements; int8 and fp4 with error "
                                       "feedback) or sparse (topk: chunked top-k, dct: top-k of each chunk's DCT, "
                                       "both of a SparseLoCo error-feedback accumulator, summed by the sparse all-gather "
                                       "or reduce-scatter the planner picks; mean aggregation only; docs/training.md)",
                               choices=("none", "fp16", "bf16", "int8", "fp4", "topk", "dct"))
    error_feedback: bool = setting(True, "add each contribution's int8 / fp4 quantization residual to the next "
                                         "committed round's contribution of the same parameters (per fragment with "
                                         "fragments); --no-error-feedback sends each round's values alone",
                                   flag="--no-error-feedback", negate=True)
    sparse_chunk: int = setting(4096, "topk / dct: elements per chunk C (indices take bit_length(C - 1) bits)")
    sparse_k: int = setting(64, "topk / dct: elements (DCT coefficients) kept per chunk; density k / C")
    sparse_bits: int = setting(2, "topk / dct: bits per kept value (2..8; sign + level, one float32 scale per "
                                  "chunk)")
    sparse_beta: float = setting(0.95, "topk / dct: decay beta of the error-feedback accumulator "
                                       "(e <- beta * e + delta; SparseLoCo)")
    local_work: str = setting("steps", "each local phase: steps (inner_steps inner steps) or time (as long as "
                                       "inner_steps steps of the fast peers, the coordinator's pace; updates weighted "
                                       "by the samples they processed; the PyTorch integration and --workload lm, "
                                       "docs/training.md)", choices=("steps", "time"))
    overlap: bool = setting(False, "the next local phase starts while the round's all-reduce runs; the committed "
                                   "update is folded in when it arrives (one-step-delayed outer update; the "
                                   "PyTorch integration and --workload lm, docs/training.md)")
    fragments: int = setting(1, "Streaming DiLoCo: the parameters split into F fragments, round r carries fragment "
                                "r mod F and local phases last inner_steps / F steps, so each fragment is "
                                "synchronised every inner_steps steps (1 = the whole model every round; the "
                                "PyTorch integration and --workload lm, docs/training.md)")
    fragment_partition: str = setting("contiguous", "how the fragments split the parameters: contiguous (F equal "
                                                    "ranges of the flat vector) or strided (layer j in fragment j mod "
                                                    "F)", choices=("contiguous", "strided"))
    fragment_overlap: int = setting(0, "Streaming DiLoCo's tau: inner steps the trainer runs while its fragment's "
                                       "round is in flight before it merges the committed fragment (0 = it waits; "
                                       "at most inner_steps / fragments)")
    fragment_alpha: float = setting(0.5, "Streaming DiLoCo's mixing factor: a committed fragment is merged as "
                                         "alpha * local + (1 - alpha) * committed")
    eager: bool = setting(False, "eager outer updates (Kale et al. 2025): at the hand-over each peer applies to its "
                                 "own working parameters an outer step on its fresh pseudo-gradient mixed with the "
                                 "delayed all-reduced one, corrected to the committed update when the round lands "
                                 "(needs overlap, or fragments > 1 with fragment_overlap > 0; the committed state "
                                 "is unchanged)")
    audit_owners: bool = setting(False, "a second shard owner recomputes every shard's aggregate and blames an "
                                        "owner that publishes another one (butterfly; doubles the reduce-scatter "
                                        "bytes; not with dp_sigma)")
    secure_aggregation: bool = setting(False, "secure aggregation (SecAgg+): every contribution is clipped, "
                                              "quantized to Z_2^32 and masked so that no peer and not the "
                                              "coordinator sees it, only the sum (mean aggregation only; "
                                              "docs/security.md)")
    secagg_degree: int = setting(4, "secure aggregation: neighbours k of each participant in the masking graph "
                                    "(even; >= participants - 1 makes it complete)")
    secagg_threshold: int = setting(3, "secure aggregation: shares t of a participant's seed that unmask it "
                                       "(2..k; t colluding neighbours can unmask it, docs/security.md)")
    secagg_clip: float = setting(4.0, "secure aggregation: each element of a (weighted) contribution is clipped "
                                      "to +-clip before quantization")
    secagg_frac_bits: int = setting(20, "secure aggregation: fixed-point fractional bits (resolution 2^-bits; "
                                        "participants x clip x 2^bits must stay below 2^31)")

    def validate(self) -> None:
        """Raise ConfigError naming the first out-of-range setting (the outer optimizer's own
        parameters are checked when the RunConfig is built)."""
        r = "run"
        _check(0 <= self.seed < 2 ** 32, r, "seed", "in 0..2**32-1", self.seed)
        _check(self.inner_steps >= 1, r, "inner_steps", ">= 1", self.inner_steps)
        _check(self.batch_size >= 1, r, "batch_size", ">= 1", self.batch_size)
        _check(self.lr > 0 and _finite(self.lr), r, "lr", "> 0", self.lr)
        _check(self.hidden >= 1, r, "hidden", ">= 1", self.hidden)
        _check(self.fedprox_mu >= 0 and _finite(self.fedprox_mu), r, "fedprox_mu", ">= 0", self.fedprox_mu)
        if self.trim_beta is not None:
            _check(0 <= self.trim_beta < 0.5, r, "trim_beta", "in [0, 0.5)", self.trim_beta)
        if self.krum_f is not None:
            _check(self.krum_f >= 0, r, "krum_f", ">= 0", self.krum_f)
        if self.krum_m is not None:
            _check(self.krum_m >= 1, r, "krum_m", ">= 1", self.krum_m)
        if self.clip_tau is not None:
            _check(self.clip_tau > 0 and _finite(self.clip_tau), r, "clip_tau", "> 0", self.clip_tau)
        if self.clip_iters is not None:
            _check(self.clip_iters >= 1, r, "clip_iters", ">= 1", self.clip_iters)
        _check(self.max_norm >= 0 and _finite(self.max_norm), r, "max_norm", ">= 0 (0 = none)", self.max_norm)
        _check(self.dp_sigma >= 0 and _finite(self.dp_sigma), r, "dp_sigma", ">= 0", self.dp_sigma)
        _check(self.dp_sigma == 0 or self.max_norm > 0, r, "dp_sigma", "0 unless max_norm is set", self.dp_sigma)
        _check(not (self.audit_owners and self.dp_sigma > 0 and self.dp_mode == "owner"), r, "audit_owners",
               "false when dp_sigma > 0 with dp_mode owner (an owner's noise cannot be recomputed)",
               self.audit_owners)
        _check(0 < self.dp_delta < 1, r, "dp_delta", "in (0, 1)", self.dp_delta)
        _check(self.dp_epsilon_budget >= 0 and _finite(self.dp_epsilon_budget), r, "dp_epsilon_budget",
               ">= 0 (0 = none)", self.dp_epsilon_budget)
        _check(self.dp_epsilon_budget == 0 or self.dp_sigma > 0, r, "dp_epsilon_budget",
               "0 unless dp_sigma > 0 (without noise no epsilon is finite)", self.dp_epsilon_budget)
        _check(self.dp_mode == "owner" or self.dp_sigma == 0 or self.aggregator in ("mean", "fedavg"), r,
               "dp_mode", f"owner when aggregator is {self.aggregator} (contributor noise is for the mean)",
               self.dp_mode)
        if self.outer_lr is not None:
            _check(self.outer_lr > 0 and _finite(self.outer_lr), r, "outer_lr", "> 0", self.outer_lr)
        _check(self.fragments >= 1 and self.inner_steps % self.fragments == 0, r, "fragments",
               f">= 1 and a divisor of inner_steps ({self.inner_steps})", self.fragments)
        phase = self.inner_steps // max(1, self.fragments)
        _check(0 <= self.fragment_overlap <= phase, r, "fragment_overlap", f"in 0..inner_steps / fragments = {phase}",
               self.fragment_overlap)
        _check(0 <= self.fragment_alpha <= 1, r, "fragment_alpha", "in [0, 1]", self.fragment_alpha)
        _check(self.fragments == 1 or not self.overlap, r, "overlap",
               "false with fragments > 1 (fragment_overlap sets how far rounds overlap)", self.overlap)
        _check(not self.eager or self.overlap or (self.fragments > 1 and self.fragment_overlap > 0), r, "eager",
               "false unless overlap, or fragments > 1 with fragment_overlap > 0 (nothing is delayed otherwise)",
               self.eager)
        self.outer_param_dict()
        _check(2 <= self.sparse_chunk <= 65536, r, "sparse_chunk", "in 2..65536", self.sparse_chunk)
        _check(1 <= self.sparse_k <= self.sparse_chunk, r, "sparse_k", f"in 1..sparse_chunk ({self.sparse_chunk})",
               self.sparse_k)
        _check(2 <= self.sparse_bits <= 8, r, "sparse_bits", "in 2..8", self.sparse_bits)
        _check(0 <= self.sparse_beta <= 1, r, "sparse_beta", "in [0, 1]", self.sparse_beta)
        if self.compression in ("topk", "dct"):
            for key, bad in (("aggregator", self.aggregator not in ("mean", "fedavg")), ("max_norm", self.max_norm > 0),
                             ("dp_sigma", self.dp_sigma > 0), ("audit_owners", self.audit_owners)):
                if bad:
                    raise ConfigError(f"{getattr(self, key)!r} does not combine with run.compression = "
                                      f"{self.compression!r} (sparse payloads are summed by every peer: mean only)",
                                      setting=f"run.{key}")

        if self.on_norm == "reject" and self.dp_mode in ("distributed", "local"):
            raise ConfigError(f"run.on_norm = 'reject'; it does not combine with run.dp_mode = {self.dp_mode!r} "
                              f"(each participant clips its own contribution: nothing is rejected)",
                              setting="run.on_norm")
        self._check_secure()

    def _check_secure(self) -> None:
        """Secure aggregation's parameters, and the settings that cannot hold with it (one line
        naming both settings)."""
        if not self.secure_aggregation:
            return
        r = "run"
        _check(self.secagg_degree >= 2 and self.secagg_degree % 2 == 0, r, "secagg_degree", "even and >= 2",
               self.secagg_degree)
        _check(2 <= self.secagg_threshold <= self.secagg_degree, r, "secagg_threshold",
               f"in 2..secagg_degree ({self.secagg_degree})", self.secagg_threshold)
        _check(self.secagg_clip > 0 and _finite(self.secagg_clip), r, "secagg_clip", "> 0", self.secagg_clip)
        _check(0 <= self.secagg_frac_bits <= 30, r, "secagg_frac_bits", "in 0..30", self.secagg_frac_bits)
        if self.secagg_max_participants() < SECURE_MIN_PEERS:
            raise ConfigError(f"run.secagg_frac_bits = {self.secagg_frac_bits}: with secagg_clip "
                              f"{self.secagg_clip:g} a sum of {SECURE_MIN_PEERS} participants overflows the ring "
                              f"({SECURE_MIN_PEERS} x {self.secagg_clip:g} x 2^{self.secagg_frac_bits} >= 2^31); "
                              f"lower secagg_frac_bits or secagg_clip", setting="run.secagg_frac_bits")
        refused = refused_with(aggregator=self.aggregator, audit_owners=self.audit_owners,
                               compression=self.compression, max_norm=self.max_norm, dp_sigma=self.dp_sigma,
                               dp_mode=self.dp_mode)
        if refused is not None:
            raise ConfigError(f"run.{refused[0]} = {refused[1]}; it does not combine with run.secure_aggregation",
                              setting=f"run.{refused[0]}")

    def secagg_max_participants(self) -> int:
        """The most participants whose fixed-point sum fits the secure-aggregation ring
        (`shoal.peer.secagg.SecAggParams.max_participants`)."""
        return SecAggParams(clip=self.secagg_clip, frac_bits=self.secagg_frac_bits).max_participants()

    def sparse_bytes_per_element(self) -> float:
        """Bytes per element of one peer's sparse payload (0 for a dense compression)."""
        if self.compression not in ("topk", "dct"):
            return 0.0
        from shoal.peer.sparse import SparseCodec

        return SparseCodec(self.compression, self.sparse_chunk, self.sparse_k, self.sparse_bits).bytes_per_element()

    def aggregator_params(self) -> dict:
        names = {"trim_beta": ("trimmed-mean", "beta"), "clip_tau": ("centered-clip", "tau"),
                 "clip_iters": ("centered-clip", "iterations"), "krum_m": ("multi-krum", "m")}
        out: dict = {}
        for attr, (agg, key) in names.items():
            if getattr(self, attr) is not None and self.aggregator == agg:
                out[key] = getattr(self, attr)
        if self.krum_f is not None and self.aggregator in ("krum", "multi-krum", "bulyan"):
            out["f"] = self.krum_f
        return out

    def outer_param_dict(self) -> dict:
        out: dict = {}
        for kv in filter(None, (x.strip() for x in self.outer_params.split(","))):
            key, sep, value = kv.partition("=")
            if not sep:
                raise ConfigError(f"run.outer_params: expected KEY=VALUE, got {kv!r}")
            try:
                out[key.strip()] = float(value)
            except ValueError:
                raise ConfigError(f"run.outer_params: {key.strip()} is not a number: {value!r}") from None
        if self.outer_lr is not None:
            out["lr"] = self.outer_lr
        return out

    def with_stored(self, run_config: dict) -> "RunSection":
        """This section with every setting a stored run configuration (`to_run_config`'s fields,
        as the coordinator's state holds them) carries; the coordinator-only settings the peers
        never see (audit_owners, the DP budget, ...) stay as they are. What a restarted
        coordinator plans by: the run's codec, aggregator, fragments and seed are the stored ones."""
        names = {f.name for f in dataclasses.fields(self)} - {"outer_params"}  # stored as a dict, not the text
        return dataclasses.replace(self, **{k: v for k, v in run_config.items() if k in names})

    def needs_butterfly(self) -> bool:
        """Robust aggregators, norm bounds and DP noise need an owner that sees every contribution."""
        owner_dp = self.dp_mode == "owner" or self.dp_sigma == 0  # else the participants clip and add noise
        return (self.aggregator not in ("mean", "fedavg") or (owner_dp and (self.max_norm > 0 or self.dp_sigma > 0))
                or self.audit_owners)

    def dp_settings(self) -> DpSettings:
        """The run's differential-privacy settings."""
        return DpSettings(sigma=self.dp_sigma, clip=self.max_norm, mode=self.dp_mode, delta=self.dp_delta,
                          epsilon_budget=self.dp_epsilon_budget, on_budget=self.dp_on_budget)

    def to_run_config(self, num_data_shards: int):
        from shoal.peer.training import RunConfig

        return RunConfig(algorithm=self.algorithm, seed=self.seed, inner_steps=self.inner_steps,
                         batch_size=self.batch_size, lr=self.lr, hidden=self.hidden, outer=self.outer,
                         num_data_shards=num_data_shards, non_iid=self.non_iid, fedprox_mu=self.fedprox_mu,
                         aggregator=self.aggregator, aggregator_params=self.aggregator_params(),
                         outer_params=self.outer_param_dict(), compression=self.compression,
                         max_norm=self.max_norm, on_norm=self.on_norm, dp_sigma=self.dp_sigma,
                         dp_mode=self.dp_mode, local_work=self.local_work, overlap=self.overlap, fragments=self.fragments,
                         fragment_partition=self.fragment_partition, fragment_overlap=self.fragment_overlap,
                         fragment_alpha=self.fragment_alpha, eager=self.eager, error_feedback=self.error_feedback,
                         sparse_chunk=self.sparse_chunk,
                         sparse_k=self.sparse_k, sparse_bits=self.sparse_bits, sparse_beta=self.sparse_beta,
                         secure_aggregation=self.secure_aggregation, secagg_degree=self.secagg_degree,
                         secagg_threshold=self.secagg_threshold, secagg_clip=self.secagg_clip,
                         secagg_frac_bits=self.secagg_frac_bits)


@dataclass(frozen=True)
class PeerSection:
    """[peer]: the agent on a volunteer machine (`shoal peer`)."""

    coordinator: str = setting("127.0.0.1:7070", "coordinator HOST:PORT; several (IP:PORT,IP:PORT: standby "
                                                 "coordinators on etcd) or a DNS name with several records: the peer "
                                                 "talks to the one that serves (the leader)")
    listen: str = setting("127.0.0.1:0", "data-plane HOST:PORT (port 0 = any free port)")
    advertise: str | None = setting(None, "data-plane HOST:PORT other peers dial (default: the bound address; "
                                          "set it behind NAT or in containers)")
    key: str | None = setting(None, "Ed25519 identity key file (created if absent, locked while the peer runs: one "
                                    "process per key); peer id = hash of it. Default: peer-NAME.key in the per-user "
                                    "data directory ($XDG_DATA_HOME/shoal or ~/.local/share/shoal)")
    name: str | None = setting(None, "names this peer's default key file (peer-NAME.key); default: the --listen port, "
                                     "or with port 0 the first of peer-1, peer-2, ... not in use")
    data_shard: int = setting(0, "which data shard (part of the default workload's training data) this peer "
                                 "holds")
    events: str | None = setting(None, "append JSON-lines round events (commit, abort, state_sync) here")
    ready_file: str | None = setting(None, "write the data-plane address here once joined")
    metrics_port: int = setting(0, "serve Prometheus /metrics on this port (0 = off)")
    metrics_host: str = setting("0.0.0.0", "address the /metrics server binds")
    rpc_timeout: float = setting(5.0, "deadline of one control-plane call, seconds")
    connect_timeout: float = setting(120.0, "give up when the coordinator stays unreachable this long")
    round_silence: float = setting(15.0, "no round event for this long: announce readiness again")
    sync_donors: int = setting(3, "donors a state sync downloads from in parallel")
    sync_range_bytes: int = setting(256 << 10, "byte range fetched per state-sync request")
    shared_memory: bool = setting(True, "move tensor chunks to peers on this host through /dev/shm (after a "
                                        "probe proves they can read it) instead of the socket",
                                  flag="--no-shared-memory", negate=True)
    tcp_lane: bool = setting(True, "move tensor chunks to peers on other hosts on a raw TCP connection (the bulk "
                                   "lane, authorised like PushChunks; mutual TLS with the certificate issued at join when "
                                   "TLS is on) instead of gRPC", flag="--no-tcp-lane", negate=True)
    bulk_connections: int = setting(16, "most TCP connections the bulk lane opens to one peer: a stream is striped "
                                        "over several when the kernel's RTT and loss show that one connection "
                                        "holds it back (peer.lanes.pool; 1 = one connection per peer)")
    outbound_only: bool = setting(False, "take part without being dialled, as behind NAT: never a shard owner nor a "
                                         "state donor; contributions go out and results come back on streams this "
                                         "peer opens (a peer the coordinator cannot dial back is so by itself; "
                                         "docs/nat.md)")
    relay: str | None = setting(None, "relay HOST:PORT (`shoal relay`) to be reached through when nobody can dial "
                                      "this peer (behind NAT): it registers there and advertises the relayed "
                                      "address it gets; several, comma-separated: the next one when a relay "
                                      "stops answering (docs/nat.md, Relays)")
    tls_dir: str | None = setting(None, "TLS directory holding ca.pem (the CA that signed the coordinator's "
                                        "certificate); the data-plane certificate is issued at join")
    mtls: bool = setting(False, "mutual TLS on the data plane (always so with the certificate issued at join); "
                                "with a legacy shared peer.key, also present peer.pem to the coordinator")
    insecure: bool = setting(False, "plaintext gRPC (logs a warning); required when there is no tls_dir")
    join_token: str = setting("", "join token from the operator (also read from $SHOAL_JOIN_TOKEN)")
    attack: str = setting("", "testing only: send forged updates, corrupt owned aggregates with owner, or "
                              "forge votes with false-blame / lying-digest (shoal.peer.testing.byzantine); empty = honest",
                          choices=("", "sign-flip", "scale", "nan", "random", "owner", "false-blame", "lying-digest"))
    attack_scale: float | None = setting(None, "strength of the attack (defaults per attack)")
    require_secure_aggregation: bool = setting(False, "leave, before sending anything, a run whose coordinator "
                                                      "has secure_aggregation off (exit code 2, one line)")
    checkpoint_dir: str | None = setting(None, "write checkpoints of the committed state here (safetensors and a "
                                               "JSON manifest per checkpoint; docs/checkpoints.md); unset = none")
    checkpoint_every: int = setting(10, "with checkpoint_dir: a checkpoint every this many committed rounds")
    checkpoint_keep: int = setting(3, "with checkpoint_dir: keep this many newest checkpoints")
    checkpoint_url: str | None = setting(None, "with checkpoint_dir: the swarm's shared checkpoint store, file://DIR or "
                                               "s3://BUCKET/PREFIX (credentials and endpoint from AWS_ACCESS_KEY_ID, "
                                               "AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL or ~/.aws; s3 needs the s3 "
                                               "extra): elected checkpointers upload there, a restarted peer takes a "
                                               "newer checkpoint from there")

    def validate(self) -> None:
        """Raise ConfigError naming the first out-of-range setting."""
        p = "peer"
        _check(self.checkpoint_dir is None or bool(self.checkpoint_dir), p, "checkpoint_dir", "a directory path",
               self.checkpoint_dir)
        _check(self.checkpoint_every >= 1, p, "checkpoint_every", ">= 1", self.checkpoint_every)
        _check(self.checkpoint_keep >= 1, p, "checkpoint_keep", ">= 1", self.checkpoint_keep)
        _check(self.checkpoint_url is None or self.checkpoint_url.startswith(("file://", "s3://")), p,
               "checkpoint_url", "file://DIR or s3://BUCKET/PREFIX", self.checkpoint_url)
        _check(self.checkpoint_url is None or bool(self.checkpoint_dir), p, "checkpoint_url",
               "only with checkpoint_dir (the local copy)", self.checkpoint_url)
        for address in self.coordinator.split(","):
            check_address(p, "coordinator", address, port_zero=False)
        check_address(p, "listen", self.listen)
        if self.advertise is not None:
            check_address(p, "advertise", self.advertise, port_zero=False)
        if self.relay is not None:
            for address in self.relay.split(","):
                check_address(p, "relay", address, port_zero=False)
            _check(self.advertise is None and not self.outbound_only, p, "relay",
                   "given without --advertise and --outbound-only (the relay's address for this peer is what it "
                   "advertises)", self.relay)
        _check(self.key is None or bool(self.key), p, "key", "a file path", self.key)
        if self.name is not None:
            _check(bool(self.name) and all(ch.isalnum() or ch in "._-" for ch in self.name)
                   and not self.name.startswith("."), p, "name", "letters, digits, '.', '_' and '-'", self.name)
        _check(self.data_shard >= 0, p, "data_shard", ">= 0", self.data_shard)
        _check(0 <= self.metrics_port <= 65535, p, "metrics_port", "in 0..65535", self.metrics_port)
        for key in ("rpc_timeout", "connect_timeout", "round_silence"):
            v = getattr(self, key)
            _check(v > 0 and _finite(v), p, key, "> 0", v)
        _check(self.sync_donors >= 1, p, "sync_donors", ">= 1", self.sync_donors)
        _check(1 <= self.bulk_connections <= 256, p, "bulk_connections", "in 1..256", self.bulk_connections)
        _check(self.sync_range_bytes >= 1024, p, "sync_range_bytes", ">= 1024", self.sync_range_bytes)
        if self.attack_scale is not None:
            _check(_finite(self.attack_scale), p, "attack_scale", "a finite number", self.attack_scale)


@dataclass(frozen=True)
class SwarmSection:
    """[swarm]: a whole local swarm on 127.0.0.1 (`shoal swarm`)."""

    peers: int = setting(4, "peer processes to start")
    summary: str | None = setting(None, "write the run summary JSON here")
    workdir: str | None = setting(None, "keep keys, state, logs and events here (default: a temporary directory)")
    progress: bool = setting(True, "show a progress bar over rounds", flag="--no-progress", negate=True)
    plot: str | None = setting(None, "write loss and accuracy per round (PNG) here; aborted/retried rounds marked")
    metrics: bool = setting(False, "give the coordinator and every peer a /metrics port (listed in the summary)")
    chaos: bool = setting(False, "kill -9 and restart random peers, SIGSTOP one, kill -9 and restart the coordinator "
                                 "(rounds default to 150 unless set)")
    chaos_interval: float = setting(2.0, "seconds between chaos actions")
    checkpoint_every: int = setting(0, "give every peer a checkpoint directory under the workdir "
                                       "(peer-N.checkpoints) and a checkpoint every this many rounds (0 = none)")
    crash_all_after: int = setting(0, "with checkpoint_every: kill -9 every process (the peers and the coordinator) "
                                      "at once after this many committed rounds, then restart them all on their state "
                                      "file and checkpoint directories; the run goes on from the newest checkpoint "
                                      "(the summary gains rewinds and rounds_lost; 0 = never)")
    crash_disk: str = setting("", "with crash_all_after, what the crash does to the peers' checkpoint directories "
                                  "before the restart: truncate (cut every peer's newest checkpoint file to half its "
                                  "size, a write the crash cut short: the restart skips it for the previous one, "
                                  "naming the file) or lose (remove them all, new machines: with checkpoint_url the "
                                  "peers resume from the shared store)", choices=("", "truncate", "lose"))
    checkpoint_url: str | None = setting(None, "with checkpoint_every: every peer's checkpoint_url (file://DIR or "
                                               "s3://BUCKET/PREFIX; credentials from the environment)")
    coordinators: int = setting(1, "coordinator processes; 2 or more share their state in a local etcd (one leads, "
                                   "the others stand by; --chaos then kills the leader; needs the etcd binary)")
    timeout: float = setting(600.0, "stop (exit 1) when the run has not finished after this many seconds; the summary "
                                     "still says what was done (timed_out, rounds_committed, the last committed model's "
                                     "test_accuracy, a baseline for the steps done)")
    byzantine: int = setting(0, "how many peers (the last K) send forged updates; needs attack")
    attack: str = setting("", "what the Byzantine peers send (owner: honest updates, corrupted owned aggregates; "
                              "false-blame, lying-digest: honest updates, forged votes)",
                          choices=("", "sign-flip", "scale", "nan", "random", "owner", "false-blame", "lying-digest"))
    attack_scale: float | None = setting(None, "strength of the attack (defaults per attack)")
    scenario: str | None = setting(None, "TOML scenario: late joiners, faults, timed events, shaped links (in network "
                                         "namespaces, root) (examples/scenarios/, docs/fault-tolerance.md); the summary "
                                         "gains events, per_peer, rounds, wrongful_exclusions")
    tls: bool = setting(False, "secure swarm: mutual TLS on both planes (certificates made in the workdir) and "
                               "admission by join token; without it the swarm runs plaintext (--insecure)")
    workload: str = setting("digits", "what the peers train: digits (numpy MLP on the UCI digits) or lm (a byte-level "
                                      "transformer language model on the Python standard library, through the PyTorch "
                                      "integration; needs torch; docs/training.md)", choices=("digits", "lm"))
    baseline: str = setting("", "with workload lm: ddp also trains the same model by synchronous data parallelism "
                                "(gloo all-reduce every step) after the swarm; the summary gains baseline_*",
                            choices=("", "ddp"))
    relay: bool = setting(False, "start a relay (`shoal relay`; in the bed's public namespace with a scenario) and "
                                 "start the NATed peers with --relay; on by itself when a scenario leaves no peer "
                                 "reachable (every peer nat or outbound-only, at least one nat); the summary gains "
                                 "relayed_bytes; not with workload lm")
    relays: int = setting(1, "with relay: how many relays to start; every relayed peer is given all of them (peer "
                             "i prefers relay i mod N) and fails over to the next when its relay stops answering")
    peer_speed: str = setting("", "with workload lm: comma-separated compute speed per peer, e.g. 1,1,1,0.33 (a peer "
                                  "at s sleeps (1/s - 1) x its step time after each inner step: an emulation; peers beyond the "
                                  "list run at 1)")
    warm_start_steps: int = setting(0, "with workload lm: before the swarm, train the model for this many "
                                       "synchronous steps (peers x batch windows each) and start every peer and the "
                                       "baseline from it, as DiLoCo starts from a pretrained model (0 = from the seed)")
    target_val_loss: float = setting(0.0, "with workload lm: the summary's seconds_to_target is when the swarm's "
                                          "validation loss first reached this (0 = 1.05 x baseline_val_loss with "
                                          "--baseline ddp, else none)")

    def validate(self) -> None:
        """Raise ConfigError naming the first out-of-range setting."""
        w = "swarm"
        _check(self.peers >= 1, w, "peers", ">= 1", self.peers)
        _check(1 <= self.coordinators <= 5, w, "coordinators", "in 1..5", self.coordinators)
        _check(1 <= self.relays <= 8, w, "relays", "in 1..8", self.relays)
        _check(self.timeout > 0 and _finite(self.timeout), w, "timeout", "> 0 seconds", self.timeout)
        _check(self.checkpoint_every >= 0, w, "checkpoint_every", ">= 0", self.checkpoint_every)
        _check(self.crash_all_after >= 0, w, "crash_all_after", ">= 0", self.crash_all_after)
        _check(not self.crash_all_after or self.checkpoint_every > 0, w, "crash_all_after",
               "only with checkpoint_every > 0", self.crash_all_after)
        _check(not self.crash_disk or self.crash_all_after > 0, w, "crash_disk", "only with crash_all_after",
               self.crash_disk)
        _check(self.checkpoint_url is None or self.checkpoint_every > 0, w, "checkpoint_url",
               "only with checkpoint_every > 0", self.checkpoint_url)
        _check(self.chaos_interval > 0 and _finite(self.chaos_interval), w, "chaos_interval", "> 0 seconds",
               self.chaos_interval)
        _check(0 <= self.byzantine <= self.peers, w, "byzantine", f"in 0..peers ({self.peers})", self.byzantine)
        _check(not self.byzantine or bool(self.attack), w, "attack", "set when byzantine > 0", self.attack)
        if self.attack_scale is not None:
            _check(_finite(self.attack_scale), w, "attack_scale", "a finite number", self.attack_scale)
        _check(not self.baseline or self.workload == "lm", w, "baseline", "only with workload lm", self.baseline)
        _check(not self.peer_speed or self.workload == "lm", w, "peer_speed", "only with workload lm", self.peer_speed)
        _check(self.warm_start_steps >= 0, w, "warm_start_steps", ">= 0", self.warm_start_steps)
        _check(not self.warm_start_steps or self.workload == "lm", w, "warm_start_steps", "only with workload lm",
               self.warm_start_steps)
        _check(self.target_val_loss >= 0 and _finite(self.target_val_loss), w, "target_val_loss", ">= 0",
               self.target_val_loss)
        _check(not self.target_val_loss or self.workload == "lm", w, "target_val_loss", "only with workload lm",
               self.target_val_loss)
        _check(_speeds_ok(self.peer_speed, self.peers), w, "peer_speed",
               f"at most peers ({self.peers}) numbers in (0, 1], comma-separated", self.peer_speed)
        for key in ("summary", "workdir", "plot", "scenario"):
            _check(getattr(self, key) != "", w, key, "a path (or unset)", "")


def parse_speeds(text: str) -> tuple[float, ...]:
    """"1,1,0.33" -> (1.0, 1.0, 0.33); "" -> (). Raises ValueError on a malformed list."""
    return tuple(float(x) for x in text.split(",")) if text.strip() else ()


def _speeds_ok(text: str, peers: int) -> bool:
    try:
        speeds = parse_speeds(text)
    except ValueError:
        return False
    return len(speeds) <= peers and all(0 < v <= 1 for v in speeds)


@dataclass(frozen=True)
class StatusSection:
    """[status]: the operator view (`shoal status`)."""

    coordinator: str = setting("127.0.0.1:7070", "coordinator HOST:PORT")
    json: bool = setting(False, "print JSON instead of tables")
    recent: int = setting(10, "recent rounds to list")
    timeout: float = setting(5.0, "deadline of the GetStatus call, seconds")
    tls_dir: str | None = setting(None, "TLS directory made by `shoal certs init` (ca.pem; peer.* for mutual TLS)")
    mtls: bool = setting(False, "mutual TLS: present a legacy peer.pem (needed against a coordinator with a legacy "
                                "shared peer.key started with mtls)")
    insecure: bool = setting(False, "plaintext gRPC; required when there is no tls_dir")

    def validate(self) -> None:
        """Raise ConfigError naming the first out-of-range setting."""
        s = "status"
        check_address(s, "coordinator", self.coordinator, port_zero=False)
        _check(self.recent >= 1, s, "recent", ">= 1", self.recent)
        _check(self.timeout > 0 and _finite(self.timeout), s, "timeout", "> 0 seconds", self.timeout)


@dataclass(frozen=True)
class RelaySection:
    """[relay]: a relay for peers nobody can dial (`shoal relay`, docs/nat.md)."""

    listen: str = setting("0.0.0.0:7071", "HOST:PORT peers register at; each registered peer gets a port of its own "
                                          "on this host")
    advertise: str | None = setting(None, "host name or IP peers and the coordinator dial the relayed ports by "
                                          "(default: the listen host)")
    stats: str | None = setting(None, "write the relay's counters (relayed_bytes, per peer) here as JSON, every second")
    ready_file: str | None = setting(None, "write the relay's HOST:PORT here once it listens")
    metrics_port: int = setting(0, "serve Prometheus /metrics on this port (0 = off)")
    metrics_host: str = setting("0.0.0.0", "address the /metrics server binds")
    capacity_mbit: float = setting(0.0, "what the relay's link carries each way, Mbit/s (0 = not declared): told to "
                                        "the peers, the planner counts the relay as a link they share")
    coordinator_key: str | None = setting(None, "the coordinator's public key (64 hex digits, as `shoal coordinator` "
                                                "logs it at start; or a file holding them): only keys with its relay "
                                                "ticket may register; unset = an open relay (a warning)")
    max_peers: int = setting(4096, "registered peers at most (one relayed port each)")
    per_client_connections: int = setting(256, "open connections to the relay's own port from one client address")
    per_peer_connections: int = setting(128, "spliced connections to one peer's relayed port")
    per_dialler_connections: int = setting(32, "of those, from one dialling address")
    idle_seconds: float = setting(120.0, "forget a registration whose control connection stayed closed this long")

    def validate(self) -> None:
        """Raise ConfigError naming the first out-of-range setting."""
        check_address("relay", "listen", self.listen)
        for key in ("max_peers", "per_client_connections", "per_peer_connections", "per_dialler_connections"):
            _check(getattr(self, key) >= 1, "relay", key, ">= 1", getattr(self, key))
        _check(self.idle_seconds > 0 and _finite(self.idle_seconds), "relay", "idle_seconds", "> 0 seconds",
               self.idle_seconds)
        _check(self.capacity_mbit >= 0 and _finite(self.capacity_mbit), "relay", "capacity_mbit", "a finite number >= 0",
               self.capacity_mbit)
        _check(0 <= self.metrics_port <= 65535, "relay", "metrics_port", "in 0..65535", self.metrics_port)
        _check(self.advertise is None or _plain_host(self.advertise), "relay", "advertise",
               "a host name or IP without a port (each relayed peer gets a port of its own)",
               self.advertise)


@dataclass(frozen=True)
class ShoalConfig:
    """The whole configuration; each command reads the sections it needs."""

    log: LogSection = LogSection()
    coordinator: CoordinatorSection = CoordinatorSection()
    rounds: RoundsSection = RoundsSection()
    run: RunSection = RunSection()
    peer: PeerSection = PeerSection()
    swarm: SwarmSection = SwarmSection()
    status: StatusSection = StatusSection()
    relay: RelaySection = RelaySection()

    def validate(self, command: str | None = None) -> None:
        """Check the sections `command` reads (every section when None); raise ConfigError
        (with `.setting`) naming the first out-of-range value."""
        sections = COMMAND_SECTIONS.get(command or "", tuple(SECTIONS))
        for section in sections:
            getattr(self, section).validate()
        if "rounds" in sections and "run" in sections and self.rounds.collective == "sparse_rs" \
                and self.run.compression not in ("topk", "dct"):
            raise ConfigError(f"'sparse_rs' needs a sparse run.compression (topk or dct), got "
                              f"{self.run.compression!r}", setting="rounds.collective")


SECTIONS: dict[str, type] = {f.name: f.type if isinstance(f.type, type) else globals()[f.type]
                             for f in dataclasses.fields(ShoalConfig)}

# Which sections each command reads (and exposes as flags).
COMMAND_SECTIONS: dict[str, tuple[str, ...]] = {
    "coordinator": ("coordinator", "rounds", "run", "log"),
    "peer": ("peer", "log"),
    "swarm": ("swarm", "rounds", "run", "log"),
    "status": ("status", "log"),
    "relay": ("relay", "log"),
}


# ---------------------------------------------------------------------------------- typing


def _base_type(section: type, name: str) -> tuple[type, bool]:
    """(scalar type, optional) of a field: str, int, float or bool."""
    hints = typing.get_type_hints(section)
    t = hints[name]
    optional = False
    if isinstance(t, types.UnionType) or typing.get_origin(t) is typing.Union:
        args = [a for a in typing.get_args(t) if a is not type(None)]
        optional, t = True, args[0]
    return t, optional


def _coerce(section: str, name: str, value: Any, source: str) -> Any:
    """Check/convert a value from TOML (typed) or the environment (a string)."""
    t, optional = _base_type(SECTIONS[section], name)
    where = f"{source}: {section}.{name}"
    if isinstance(value, str) and source.startswith("env"):
        if optional and value == "":
            return None
        try:
            if t is bool:
                low = value.strip().lower()
                if low not in _TRUE | _FALSE:
                    raise ValueError(value)
                value = low in _TRUE
            else:
                value = t(value)
        except ValueError:
            raise ConfigError(f"{where}: cannot parse {value!r} as {t.__name__}") from None
    if t is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, t) or (t is int and isinstance(value, bool)):
        raise ConfigError(f"{where}: expected {t.__name__}, got {type(value).__name__} {value!r}")
    choices = _meta(section, name)["choices"]
    if choices and value not in choices:
        raise ConfigError(f"{where}: {value!r} is not one of {', '.join(choices)}")
    return value


def _meta(section: str, name: str) -> Mapping[str, Any]:
    return next(f.metadata for f in dataclasses.fields(SECTIONS[section]) if f.name == name)


def env_name(section: str, name: str) -> str:
    return f"{ENV_PREFIX}{section.upper()}_{name.upper()}"


def flag_name(section: str, name: str) -> str:
    return _meta(section, name)["flag"] or "--" + name.replace("_", "-")


# ---------------------------------------------------------------------------------- layers


def suggest(section: str, key: str) -> tuple[str, str] | None:
    """The setting (section, key) a misspelt `section.key` most likely means, or None: a key of
    that name in another table first, then the closest key of the table."""
    for other, cls in SECTIONS.items():
        if other != section and key in {f.name for f in dataclasses.fields(cls)}:
            return other, key
    names = [f.name for f in dataclasses.fields(SECTIONS[section])]
    close = difflib.get_close_matches(key, names, n=1)
    return (section, close[0]) if close else None


def read_toml(path: str, flag: str, error: type[ValueError] = ConfigError) -> dict[str, Any]:
    """The TOML file `path` as parsed tables; every file a command reads (its --config, a swarm's
    --scenario) is read here. Raises `error` "<flag> <path>: <why>" when the file cannot be read
    or is not TOML."""
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as exc:
        raise error(f"{flag} {path}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise error(f"{flag} {path}: {exc}") from None


def read_file(path: str) -> dict[str, dict[str, Any]]:
    """The overrides of a TOML file, checked: {section: {key: value}}. Raises ConfigError."""
    raw = read_toml(path, "--config")
    out: dict[str, dict[str, Any]] = {}
    for section, table in raw.items():
        if section not in SECTIONS or not isinstance(table, dict):
            close = difflib.get_close_matches(str(section), SECTIONS, n=1)
            hint = f"did you mean [{close[0]}]?" if close else f"known: {', '.join(SECTIONS)}"
            raise ConfigError(f"{path}: unknown table [{section}] ({hint})")
        known = {f.name for f in dataclasses.fields(SECTIONS[section])}
        for key, value in table.items():
            if key not in known:
                near = suggest(section, key)
                hint = f" (did you mean {near[0]}.{near[1]}?)" if near else ""
                raise ConfigError(f"{path}: unknown key {section}.{key}{hint}")
            out.setdefault(section, {})[key] = _coerce(section, key, value, f"file {path}")
    return out


def read_env(environ: Mapping[str, str]) -> dict[str, dict[str, Any]]:
    """The overrides found in `environ` (SHOAL_<SECTION>_<KEY>). Unknown SHOAL_ names are errors
    only when they start with a known section (so SHOAL_HOME and the like stay usable)."""
    out: dict[str, dict[str, Any]] = {}
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            name = env_name(section, f.name)
            if name in environ:
                out.setdefault(section, {})[f.name] = _coerce(section, f.name, environ[name], f"env {name}")
    known = {env_name(s, f.name) for s, c in SECTIONS.items() for f in dataclasses.fields(c)}
    for name in environ:
        if name.startswith(ENV_PREFIX) and name not in known and \
                any(name.startswith(f"{ENV_PREFIX}{s.upper()}_") for s in SECTIONS):
            section = next(s for s in SECTIONS if name.startswith(f"{ENV_PREFIX}{s.upper()}_"))
            near = suggest(section, name[len(f"{ENV_PREFIX}{section}_"):].lower())
            hint = f" (did you mean {env_name(*near)}?)" if near else ""
            raise ConfigError(f"env {name}: unknown setting{hint}")
    return out


def merge(base: ShoalConfig, overrides: Mapping[str, Mapping[str, Any]]) -> ShoalConfig:
    """`base` with `overrides` ({section: {key: value}}, already typed) applied."""
    changes = {}
    for section, values in overrides.items():
        if values:
            changes[section] = dataclasses.replace(getattr(base, section), **values)
    return dataclasses.replace(base, **changes)


def load(config_path: str | None = None, environ: Mapping[str, str] | None = None,
         flags: Mapping[str, Mapping[str, Any]] | None = None, *, sources: dict[str, str] | None = None,
         command: str | None = None) -> ShoalConfig:
    """Defaults < file < environment < flags, then `ShoalConfig.validate(command)`.

    Raises ConfigError on any bad setting; a value out of range is reported as the layer that
    set it ("--peers: must be >= 1, got 0", "env SHOAL_SWARM_PEERS: ...", "file x.toml:
    swarm.peers: ..."). `sources`, when given, receives "section.key" -> the layer ("file",
    "env", "flag") that set it."""
    layers = [("file", read_file(config_path) if config_path else {}),
              ("env", read_env(os.environ if environ is None else environ)),
              ("flag", dict(flags or {}))]
    cfg = ShoalConfig()
    where: dict[str, str] = {}
    for layer, overrides in layers:
        cfg = merge(cfg, overrides)
        where.update({f"{sec}.{key}": layer for sec, values in overrides.items() for key in values})
    if sources is not None:
        sources.update(where)
    try:
        cfg.validate(command)
    except ConfigError as exc:
        if exc.setting is None:
            raise
        raise ConfigError(f"{describe(exc.setting, where.get(exc.setting), config_path)}: {exc}",
                          setting=exc.setting) from None
    return cfg


def describe(setting: str, layer: str | None, config_path: str | None = None) -> str:
    """How the user spelled `setting` ("section.key") in `layer`: the flag, the environment
    variable, or the file and key; the flag and the key for a default."""
    section, key = setting.split(".", 1)
    if layer == "flag":
        return flag_name(section, key)
    if layer == "env":
        return f"env {env_name(section, key)}"
    if layer == "file":
        return f"file {config_path}: {setting}"
    return f"{flag_name(section, key)} ({setting})"


# ---------------------------------------------------------------------------------- argparse


def _dest(section: str, name: str) -> str:
    return f"cfg__{section}__{name}"


def add_flags(parser: argparse.ArgumentParser, command: str) -> None:
    """Add `--config` and one flag per setting of the command's sections. Flags default to
    "not given" (argparse.SUPPRESS) so that only what the user typed overrides file and env."""
    parser.add_argument("--config", metavar="PATH", help="TOML configuration file (precedence: file < "
                        "SHOAL_* environment < flags; see docs/configuration.md)")
    for section in COMMAND_SECTIONS[command]:
        cls = SECTIONS[section]
        group = parser.add_argument_group(f"[{section}]", (cls.__doc__ or "").split(":", 1)[-1].strip())
        for f in dataclasses.fields(cls):
            t, _ = _base_type(cls, f.name)
            meta = f.metadata
            env = env_name(section, f.name)
            if meta["negate"]:  # the flag turns the setting off: say what the flag does
                text = f"do not {meta['help']} (env {env}=false)"
            elif f.default is None:  # unset: the help says what happens then
                text = f"{meta['help']} (env {env})"
            else:
                text = f"{meta['help']} (default: {f.default!r}; env {env})"
            kw: dict[str, Any] = {"dest": _dest(section, f.name), "default": argparse.SUPPRESS, "help": text}
            if t is bool:
                kw.update(action="store_const", const=not meta["negate"])
            else:
                kw.update(type=t, metavar=f.name.upper())
                if meta["choices"]:
                    kw.update(choices=meta["choices"])
                    del kw["metavar"]
            group.add_argument(flag_name(section, f.name), **kw)


def flags_from_args(a: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """The settings given as flags, {section: {key: value}}."""
    out: dict[str, dict[str, Any]] = {}
    for key, value in vars(a).items():
        if key.startswith("cfg__"):
            _, section, name = key.split("__", 2)
            out.setdefault(section, {})[name] = value
    return out


def to_flags(cfg: ShoalConfig, section: str, *, only_changed: bool = True, **replace: Any) -> list[str]:
    """Command-line flags that reproduce `cfg.<section>` (with `replace` applied) in a child process."""
    obj = dataclasses.replace(getattr(cfg, section), **replace)
    default = SECTIONS[section]()
    argv: list[str] = []
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if value is None or (only_changed and value == getattr(default, f.name) and f.name not in replace):
            continue
        t, _ = _base_type(SECTIONS[section], f.name)
        if t is bool:
            if value != f.default:
                argv.append(flag_name(section, f.name))
            continue
        argv += [flag_name(section, f.name), str(value)]
    return argv


# ---------------------------------------------------------------------------------- docs


def render_markdown() -> str:
    """docs/configuration.md, generated from the dataclasses (scripts/gen_config_docs.py)."""
    lines = [
        "# Configuration",
        "",
        ("<!-- Generated by scripts/gen_config_docs.py from shoal/config.py and coordinator/settings.py; "
         "do not edit by hand. -->"),
        "",
        "Every command reads its settings from four layers, each overriding the previous one:",
        "",
        "    built-in defaults  <  TOML file (--config PATH)  <  environment (SHOAL_<SECTION>_<KEY>)  <  flags",
        "",
        "Unknown keys, wrong types and unparsable values are errors (exit code 2), never ignored.",
        "Booleans in the environment accept 1/0, true/false, yes/no, on/off; an empty value unsets an",
        "optional setting. A complete example file is `deploy/shoal.toml`.",
        "",
        "```toml",
        "[rounds]",
        "rounds = 100",
        "min_peers = 3",
        "",
        "[run]",
        "algorithm = \"fedavg\"",
        "```",
        "",
        "| command | sections it reads |",
        "| --- | --- |",
    ]
    for cmd, secs in COMMAND_SECTIONS.items():
        lines.append(f"| `shoal {cmd}` | {', '.join(f'[{s}]' for s in secs)} |")
    for section, cls in SECTIONS.items():
        lines += ["", f"## [{section}]", "", (cls.__doc__ or "").split(":", 1)[-1].strip(), "",
                  "| key | env | flag | default | meaning |", "| --- | --- | --- | --- | --- |"]
        for f in dataclasses.fields(cls):
            default = "unset" if f.default is None else f"`{_toml_literal(f.default)}`"
            meaning = f.metadata["help"]
            if f.metadata["choices"]:
                meaning += f" (one of: {', '.join(f.metadata['choices'])})"
            flag = flag_name(section, f.name)
            lines.append(f"| `{f.name}` | `{env_name(section, f.name)}` | `{flag}` | {default} | {meaning} |")
    lines += ["", "Exit codes of every command are listed in `shoal --help` and in `shoal/cli/__init__.py`.", ""]
    return "\n".join(lines)


def _toml_literal(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return f'"{v}"'
    return repr(v)
