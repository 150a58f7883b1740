"""User errors of the `shoal` command: one line naming what is wrong, the documented exit code,
no traceback, nothing started. Real processes where the network is involved."""

from __future__ import annotations

import pathlib
import sys

import pytest

from shoal import cli, config
from shoal.config import ConfigError

from kits.cli import one_line_error

ROOT = pathlib.Path(__file__).resolve().parents[2]



# ------------------------------------------------------------------------------ validation (A)


@pytest.mark.parametrize("argv, names", [
    (["swarm", "--peers", "0"], "--peers"),
    (["swarm", "--peers", "-1"], "--peers"),
    (["swarm", "--rounds", "-5"], "--rounds"),
    (["swarm", "--timeout", "-1"], "--timeout"),
    (["swarm", "--lease-seconds", "0"], "--lease-seconds"),
    (["swarm", "--lr", "-1"], "--lr"),
    (["swarm", "--lr", "nan"], "--lr"),
    (["swarm", "--chunk-bytes", "0"], "--chunk-bytes"),
    (["swarm", "--chunk-bytes", "1023"], "--chunk-bytes"),
    (["swarm", "--aggregator", "krum", "--krum-f", "-1"], "--krum-f"),
    (["swarm", "--hidden", "0"], "--hidden"),
    (["swarm", "--seed", "-1"], "--seed"),
    (["swarm", "--batch-size", "0"], "--batch-size"),
    (["swarm", "--byzantine", "1"], "--attack"),
    (["peer", "--insecure", "--data-shard", "-1"], "--data-shard"),
    (["peer", "--insecure", "--advertise", "10.0.0.1:0"], "--advertise"),
    (["peer", "--insecure", "--listen", "127.0.0.1:99999"], "--listen"),
    (["peer", "--insecure", "--listen", "garbage"], "--listen"),
    (["peer", "--insecure", "--coordinator", "nohost"], "--coordinator"),
    (["coordinator", "--insecure", "--listen", ":7070"], "--listen"),
    (["status", "--insecure", "--recent", "0"], "--recent"),
])
def test_out_of_range_settings_are_one_line_and_exit_2(argv, names, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # nothing may be created: checked below
    assert cli.main(argv) == cli.EXIT_USAGE
    line = one_line_error(capsys.readouterr().err)
    assert line.startswith(f"shoal {argv[0]}: ") and names in line, line
    assert list(tmp_path.iterdir()) == []


def test_the_error_names_the_layer_that_set_the_value(tmp_path):
    with pytest.raises(ConfigError, match=r"^env SHOAL_SWARM_PEERS: must be >= 1, got 0$"):
        config.load(None, {"SHOAL_SWARM_PEERS": "0"}, command="swarm")
    p = tmp_path / "s.toml"
    p.write_text("[rounds]\nchunk_bytes = 10\n")
    with pytest.raises(ConfigError, match=r"s\.toml: rounds\.chunk_bytes: must be >= 1024, got 10"):
        config.load(str(p), {}, command="coordinator")
    # A command checks only the sections it reads: a shared file may hold other commands' tables.
    p.write_text("[swarm]\npeers = 0\n")
    config.load(str(p), {}, command="peer")


def test_every_default_is_valid():
    config.ShoalConfig().validate()


def test_a_swarm_of_zero_rounds_is_refused_instead_of_running_forever(capsys):
    assert cli.main(["swarm", "--rounds", "0"]) == cli.EXIT_USAGE
    line = one_line_error(capsys.readouterr().err)
    assert "--rounds 0" in line and "shoal coordinator" in line


def test_min_peers_above_peers_is_an_error_not_a_silent_cap(capsys):
    assert cli.main(["swarm", "--peers", "2", "--min-peers", "3"]) == cli.EXIT_USAGE
    line = one_line_error(capsys.readouterr().err)
    assert "--min-peers 3" in line and "--peers 2" in line


@pytest.mark.parametrize("peers, says", [("2", "needs 3 participants"), ("600", "more than 511 participants")])
def test_a_secure_swarm_too_small_or_too_large_for_its_ring_is_refused(peers, says, capsys):
    assert cli.main(["swarm", "--peers", peers, "--secure-aggregation"]) == cli.EXIT_USAGE
    line = one_line_error(capsys.readouterr().err)
    assert f"--peers {peers}" in line and "--secure-aggregation" in line and says in line


def test_run_config_checks_its_own_ranges():
    from shoal.common.errors import InvalidArgument
    from shoal.peer.training import RunConfig

    for bad in ({"batch_size": 0}, {"hidden": 0}, {"lr": 0.0}, {"lr": float("nan")}, {"seed": -1}):
        with pytest.raises(InvalidArgument, match=next(iter(bad))):
            RunConfig(**bad)


# ------------------------------------------------------------------------------ files (B)


def test_swarm_paths_are_checked_before_anything_starts(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["swarm", "--workdir", "/proc/nope"]) == cli.EXIT_USAGE
    assert "--workdir /proc/nope" in one_line_error(capsys.readouterr().err)
    assert cli.main(["swarm", "--summary", str(tmp_path / "no" / "dir" / "s.json")]) == cli.EXIT_USAGE
    assert "--summary" in one_line_error(capsys.readouterr().err)
    assert list(tmp_path.iterdir()) == []


def test_plot_without_matplotlib_says_what_to_install(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails
    assert cli.main(["swarm", "--plot", str(tmp_path / "c.png")]) == cli.EXIT_USAGE
    assert 'pip install -e ".[plot]"' in one_line_error(capsys.readouterr().err)


# ------------------------------------------------------------------------------ status over TLS (D)


def test_status_shows_a_zero_loss():
    from shoal.cli.status import render_table

    s = {"coordinator": "x:1", "epoch": 1, "round": 1, "rounds_committed": 1, "rounds_aborted": 1,
         "run_config": {}, "members": [],
         "rounds": [{"round": 0, "attempt": 0, "status": "committed", "participants": 2, "seconds": 0.5,
                     "train_loss": 0.0, "reason": "", "state_digest": ""},
                    {"round": 1, "attempt": 0, "status": "aborted", "participants": 0, "seconds": 0.0,
                     "train_loss": 0.0, "reason": "timeout", "state_digest": ""}]}
    rows = render_table(s).splitlines()[-2:]
    assert "0.0000" in rows[0] and "0.0000" not in rows[1]


# ------------------------------------------------------------------------------ coordinator (H)


def test_run_finished_is_logged_once(caplog):
    from shoal.coordinator.rounds import SendFinished
    from shoal.coordinator.server import CoordinatorService

    service = CoordinatorService(None, None, "{}", None)  # apply(SendFinished) touches neither
    with caplog.at_level("INFO", logger="shoal.coordinator"):
        for _ in range(3):  # the engine answers every late Ready with SendFinished
            service.apply([SendFinished(5, "run complete")])
    assert [r.getMessage() for r in caplog.records].count("run finished after 5 committed rounds") == 1


def test_round_gauge_moves_on_commit():
    from shoal.common.metrics import CoordinatorMetrics

    m = CoordinatorMetrics()
    m.on_commit(0.1, rounds_committed=3)
    assert m.registry.get_sample_value("shoal_coordinator_round") == 3


@pytest.mark.parametrize("argv, names", [
    (["swarm", "--local-work", "sometimes"], ["--local-work", "invalid choice: 'sometimes'"]),
    (["swarm", "--workload", "text"], ["--workload", "invalid choice: 'text'"]),
    (["swarm", "--overlap=1"], ["--overlap", "ignored explicit argument '1'"]),
    (["swarm", "--overlap", "yes"], ["shoal swarm: ", "--overlap", "takes no value (got 'yes')"]),
    (["swarm", "--peers", "3", "--overlap", "yes", "--rounds", "2"], ["--overlap", "'yes'"]),
    (["swarm", "--peers", "four"], ["--peers", "'four'"]),
    (["certs", "nothing"], ["invalid choice: 'nothing'"]),
    (["swarm", "--foo"], ["shoal swarm: ", "unrecognized arguments: --foo", "see shoal swarm --help"]),
    (["bench", "allreduce", "--sparse-bata", "0.5"],
     ["shoal bench allreduce: ", "unrecognized arguments: --sparse-bata 0.5", "see shoal bench allreduce --help"]),
    (["certs", "init", "--out", "x", "--bar"], ["shoal certs init: ", "unrecognized arguments: --bar"]),
])
def test_a_flag_parsing_error_is_one_line_naming_the_flag(argv, names, capsys):
    """argparse's own errors (a bad choice, a value that is not a number): one line, exit 2, not
    the whole usage first (a new user's report: 38 lines for `shoal swarm --local-work sometimes`)."""
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    line = one_line_error(capsys.readouterr().err)
    assert all(n in line for n in names) and "--help" in line


def test_status_names_the_compression_and_its_bytes_per_element():
    from shoal.cli.status import compression_cost, render_table

    s = {"coordinator": "x:1", "epoch": 1, "round": 1, "rounds_committed": 1, "rounds_aborted": 0,
         "members": [], "rounds": [],
         "run_config": {"compression": "topk", "sparse_chunk": 4096, "sparse_k": 64, "sparse_bits": 2,
                        "sparse_beta": 0.95}}
    assert ("compression topk (k 64 of 4096 = 1.56 %, 2-bit values, beta 0.95): 0.0283 bytes per element "
            "(141x less than float32)") in render_table(s)
    assert "compression int8: 1.0156 bytes per element" in render_table({**s, "run_config": {"compression": "int8"}})
    assert "compression none: 4.0000 bytes per element" in render_table({**s, "run_config": {"algorithm": "diloco"}})
    # `shoal status --json` carries the same figures (fetch_status's "compression")
    cost = compression_cost(s["run_config"])
    assert cost["name"] == "topk" and round(cost["bytes_per_element"], 4) == 0.0283
    assert round(cost["float32_over_these"]) == 141
    assert compression_cost({"compression": "int8"})["float32_over_these"] == pytest.approx(4 / 1.015625)
    assert compression_cost({"compression": "zstd"}) == {"name": "zstd", "bytes_per_element": None,
                                                         "float32_over_these": None}
