"""Configuration: defaults < TOML file < SHOAL_* environment < flags, errors, generated docs."""

from __future__ import annotations

import dataclasses
import pathlib

import pytest

from shoal import cli, config
from shoal.config import ConfigError, ShoalConfig
from shoal.coordinator.planner import PlanPolicy
from shoal.coordinator.rounds import EngineConfig
from shoal.coordinator.settings import RoundSettings

ROOT = pathlib.Path(__file__).resolve().parents[2]


def parse(argv: list[str], environ: dict[str, str] | None = None) -> ShoalConfig:
    a = cli.build_parser().parse_args(argv)
    return cli.load_config(a, environ or {})


@pytest.fixture
def toml(tmp_path):
    p = tmp_path / "shoal.toml"
    p.write_text('[rounds]\nrounds = 7\nmin_peers = 3\nlease_seconds = 4\n\n'
                 '[run]\nalgorithm = "fedavg"\nlr = 0.01\nnon_iid = true\n\n'
                 '[peer]\ncoordinator = "file:1"\ndata_shard = 2\n\n[log]\nlevel = "warning"\n')
    return str(p)


def test_defaults_match_the_dataclasses():
    cfg = parse(["swarm"])
    assert cfg == ShoalConfig()
    assert cfg.rounds.rounds == 20 and cfg.run.algorithm == "diloco" and cfg.swarm.progress is True


def test_file_then_env_then_flags(toml):
    cfg = parse(["swarm", "--config", toml])
    assert (cfg.rounds.rounds, cfg.rounds.min_peers, cfg.run.algorithm, cfg.run.non_iid) == (7, 3, "fedavg", True)
    assert cfg.rounds.lease_seconds == 4.0 and isinstance(cfg.rounds.lease_seconds, float)
    assert cfg.log.level == "warning"

    env = {"SHOAL_ROUNDS_ROUNDS": "9", "SHOAL_RUN_LR": "0.5", "SHOAL_RUN_NON_IID": "no", "SHOAL_LOG_LEVEL": "debug"}
    cfg = parse(["swarm", "--config", toml], env)
    assert (cfg.rounds.rounds, cfg.run.lr, cfg.run.non_iid, cfg.log.level) == (9, 0.5, False, "debug")
    assert cfg.rounds.min_peers == 3  # untouched by env: the file's value stays

    cfg = parse(["swarm", "--config", toml, "--rounds", "11", "--log-level", "error", "--no-progress"], env)
    assert (cfg.rounds.rounds, cfg.log.level, cfg.swarm.progress) == (11, "error", False)
    assert cfg.run.lr == 0.5 and cfg.rounds.min_peers == 3


def test_each_command_reads_its_sections(toml):
    cfg = parse(["peer", "--config", toml, "--listen", "127.0.0.1:9"], {"SHOAL_PEER_DATA_SHARD": "5"})
    assert (cfg.peer.coordinator, cfg.peer.data_shard, cfg.peer.listen) == ("file:1", 5, "127.0.0.1:9")
    cfg = parse(["status", "--coordinator", "x:1", "--json"])
    assert cfg.status.coordinator == "x:1" and cfg.status.json is True
    cfg = parse(["coordinator", "--metrics-port", "9100", "--inner-steps", "3"])
    assert cfg.coordinator.metrics_port == 9100 and cfg.run.inner_steps == 3
    assert cfg.rounds.to_engine_config().rounds == 20
    assert cfg.run.to_run_config(4).inner_steps == 3


@pytest.mark.parametrize("text, match", [
    ("[rounds]\nrounds = \"many\"\n", "expected int"),
    ("[rounds]\nbogus = 1\n", "unknown key rounds.bogus"),
    ("[nosuch]\nx = 1\n", "unknown table"),
    ("[run]\nalgorithm = \"sgd\"\n", "not one of"),
    ("[rounds\n", "shoal.toml"),
])
def test_bad_file_is_an_error(tmp_path, text, match):
    p = tmp_path / "shoal.toml"
    p.write_text(text)
    with pytest.raises(ConfigError, match=match):
        config.load(str(p), {})


@pytest.mark.parametrize("env, match", [
    ({"SHOAL_ROUNDS_ROUNDS": "x"}, "cannot parse"),
    ({"SHOAL_RUN_NON_IID": "maybe"}, "cannot parse"),
    ({"SHOAL_PEER_NOSUCH": "1"}, "unknown setting"),
])
def test_bad_env_is_an_error(env, match):
    with pytest.raises(ConfigError, match=match):
        config.load(None, env)


def test_unrelated_shoal_env_is_ignored():
    assert config.load(None, {"SHOAL_HOME": "/x"}) == ShoalConfig()


def test_optional_setting_unset_by_empty_env():
    assert config.load(None, {"SHOAL_SWARM_SUMMARY": ""}).swarm.summary is None
    assert config.load(None, {"SHOAL_SWARM_SUMMARY": "s.json"}).swarm.summary == "s.json"


def test_exit_code_2_on_bad_configuration(tmp_path):
    p = tmp_path / "bad.toml"
    p.write_text("[rounds]\nrounds = -\n")
    assert cli.main(["swarm", "--config", str(p)]) == cli.EXIT_USAGE
    assert cli.main(["status", "--config", str(tmp_path / "missing.toml")]) == cli.EXIT_USAGE
    with pytest.raises(SystemExit) as exc:
        cli.main(["swarm", "--rounds", "x"])
    assert exc.value.code == cli.EXIT_USAGE


def test_to_flags_round_trips():
    cfg = parse(["swarm", "--rounds", "3", "--non-iid", "--lr", "0.1"])
    argv = config.to_flags(cfg, "rounds") + config.to_flags(cfg, "run")
    back = parse(["coordinator", *argv])
    assert back.rounds == cfg.rounds and back.run == cfg.run


def test_configuration_doc_is_generated_and_complete():
    doc = (ROOT / "docs" / "configuration.md").read_text()
    assert doc == config.render_markdown(), "stale: run python scripts/gen_config_docs.py"
    for section, cls in config.SECTIONS.items():
        for f in dataclasses.fields(cls):
            assert f"| `{f.name}` | `{config.env_name(section, f.name)}` |" in doc


def test_deploy_example_config_is_valid():
    cfg = config.load(str(ROOT / "deploy" / "shoal.toml"), {})
    assert cfg.coordinator.metrics_port == 9100 and cfg.peer.coordinator == "coordinator:7070"


def test_observability_doc_lists_every_metric():
    import importlib.util

    from shoal.common.metrics import COORDINATOR_METRICS, PEER_METRICS

    spec = importlib.util.spec_from_file_location("gen_config_docs", ROOT / "scripts" / "gen_config_docs.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    doc = (ROOT / "docs" / "observability.md").read_text()
    assert doc == gen.observability(doc), "stale: run python scripts/gen_config_docs.py"
    for m in (*COORDINATOR_METRICS, *PEER_METRICS):
        assert f"`{m.name}`" in doc


def test_sources_name_the_layer_of_each_setting(toml):
    sources: dict[str, str] = {}
    a = cli.build_parser().parse_args(["swarm", "--config", toml, "--peers", "3"])
    cli.load_config(a, {"SHOAL_RUN_SEED": "4", "SHOAL_ROUNDS_ROUNDS": "8"}, sources=sources)
    assert sources["swarm.peers"] == "flag" and sources["run.seed"] == "env" and sources["rounds.rounds"] == "env"
    assert sources["rounds.min_peers"] == "file" and "run.hidden" not in sources


def _other_value(f: dataclasses.Field):
    """A valid value of setting `f` other than its default."""
    if f.metadata["choices"]:
        return next(c for c in f.metadata["choices"] if c != f.default)
    return f.default + 1 if isinstance(f.default, int) else f.default * 2 + 0.5


def test_every_rounds_setting_reaches_the_engine_and_the_planner():
    """Each [rounds] setting, set away from its default, arrives in the engine's config under
    its own name, and every one the planner reads arrives in its policy."""
    fields = dataclasses.fields(config.RoundsSection)
    changed = {f.name: _other_value(f) for f in fields}
    assert set(changed) == {f.name for f in dataclasses.fields(RoundSettings)} and len(changed) >= 18
    rounds = dataclasses.replace(config.RoundsSection(), **changed)
    rounds.validate()
    run = config.RunSection(aggregator="median", compression="int8", audit_owners=True, seed=7)
    engine = rounds.to_engine_config(run)
    for name, value in changed.items():
        want = "butterfly" if name == "collective" else value  # a median needs the butterfly
        assert getattr(engine, name) == want, name
    assert (engine.aggregator, engine.compression, engine.audit_owners, engine.cohort_seed) == ("median", "int8",
                                                                                                True, 7)
    policy = engine.plan_policy()
    shared = {f.name for f in dataclasses.fields(PlanPolicy)} & {f.name for f in dataclasses.fields(EngineConfig)}
    assert {"collective", "chunk_bytes", "chunk_timeout", "link_cap_bytes_per_s", "aggregator"} <= shared
    for name in shared:
        assert getattr(policy, name) == getattr(engine, name), name
    plain = config.RoundsSection(collective="ring").to_engine_config()
    assert plain.collective == "ring" and plain.plan_policy().collective == "ring"


def test_the_planner_defaults_are_the_round_settings():
    """The planner's and the engine's defaults of a [rounds] setting are the setting's default."""
    defaults, policy, engine = RoundSettings(), PlanPolicy(), EngineConfig()
    for f in dataclasses.fields(RoundSettings):
        if f.name in {g.name for g in dataclasses.fields(PlanPolicy)}:
            assert getattr(policy, f.name) == f.default, f.name
        if f.name != "rounds":  # the engine alone runs forever unless told
            assert getattr(engine, f.name) == getattr(defaults, f.name), f.name


@pytest.mark.parametrize("section,old", [("peer", "shard"), ("coordinator", "num_shards"),
                                         ("rounds", "straggler_timeout"), ("rounds", "algorithm_collective")])
def test_removed_names_are_unknown_settings(tmp_path, section, old):
    """Names the settings had before they were renamed are errors, like any unknown key."""
    command = {"peer": "peer", "coordinator": "coordinator", "rounds": "coordinator"}[section]
    toml = tmp_path / "old.toml"
    toml.write_text(f"[{section}]\n{old} = 1\n")
    with pytest.raises(ConfigError, match=f"unknown key {section}.{old}"):
        parse([command, "--config", str(toml), "--insecure"])
    with pytest.raises(ConfigError, match="unknown setting"):
        parse([command, "--insecure"], {config.env_name(section, old): "1"})


def test_the_sparse_reduce_scatter_needs_a_sparse_compression(tmp_path):
    p = tmp_path / "shoal.toml"
    p.write_text('[rounds]\ncollective = "sparse_rs"\n')
    with pytest.raises(ConfigError, match="'sparse_rs' needs a sparse run.compression") as err:
        config.load(str(p), {}).validate("swarm")
    assert err.value.setting == "rounds.collective"
    p.write_text('[rounds]\ncollective = "sparse_rs"\n[run]\ncompression = "topk"\n')
    config.load(str(p), {}).validate("swarm")
