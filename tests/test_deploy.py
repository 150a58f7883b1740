"""deploy/: the compose file validates, the image runs as non-root, Prometheus scrapes every service."""

from __future__ import annotations

import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"


@pytest.fixture(scope="module")
def compose_config() -> str:
    exe = shutil.which("docker-compose")
    if exe is None:
        pytest.skip("docker-compose is not installed (Debian: apt-get install -y docker-compose)")
    out = subprocess.run([exe, "-f", str(DEPLOY / "docker-compose.yml"), "config"], capture_output=True, text=True,
                         timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    return out.stdout


@pytest.mark.integration
def test_compose_config_is_valid(compose_config):
    for service in ("coordinator:", "peer1:", "peer2:", "peer3:", "peer4:", "prometheus:"):
        assert service in compose_config
    assert compose_config.count("SHOAL_PEER_ADVERTISE") == 4


def test_prometheus_scrapes_the_coordinator_and_every_peer():
    text = (DEPLOY / "prometheus.yml").read_text()
    for target in ("coordinator:9100", "peer1:9100", "peer2:9100", "peer3:9100", "peer4:9100"):
        assert target in text


def test_dockerfile_is_slim_and_non_root():
    text = (DEPLOY / "Dockerfile").read_text()
    assert "FROM python:3.11-slim" in text and "pip install ." in text
    user = [line for line in text.splitlines() if line.startswith("USER ")]
    assert user and user[-1].split()[1].split(":")[0] not in ("root", "0")


def test_kubernetes_manifests_parse():
    yaml = pytest.importorskip("yaml", reason="PyYAML is not installed")
    kinds = [d["kind"] for f in sorted((DEPLOY / "k8s").glob("*.yaml")) for d in yaml.safe_load_all(f.read_text())
             if d and "kind" in d]
    assert {"ConfigMap", "Service", "StatefulSet"} <= set(kinds)


def k8s_shoal_toml() -> str:
    """The TOML embedded in deploy/k8s/configmap.yaml (the `shoal.toml: |` block scalar)."""
    lines = (DEPLOY / "k8s" / "configmap.yaml").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == "shoal.toml: |") + 1
    indent = len(lines[start]) - len(lines[start].lstrip())
    block = []
    for line in lines[start:]:
        if line.strip() and len(line) - len(line.lstrip()) < indent:
            break
        block.append(line[indent:])
    return "\n".join(block) + "\n"


def test_k8s_configmap_block_is_what_yaml_reads():
    yaml = pytest.importorskip("yaml", reason="PyYAML is not installed")
    doc = yaml.safe_load((DEPLOY / "k8s" / "configmap.yaml").read_text())
    assert doc["data"]["shoal.toml"].strip() == k8s_shoal_toml().strip()


@pytest.fixture(params=["compose", "k8s"])
def deploy_toml(request, tmp_path) -> pathlib.Path:
    if request.param == "compose":
        return DEPLOY / "shoal.toml"
    path = tmp_path / "k8s-shoal.toml"
    path.write_text(k8s_shoal_toml())
    return path


def test_deploy_configs_are_valid_for_every_command(deploy_toml):
    from shoal import config

    for command in ("coordinator", "peer"):
        cfg = config.load(str(deploy_toml), {}, command=command)
        section = getattr(cfg, command)
        # Exactly one of TLS and explicit plaintext, or the process refuses to start.
        assert bool(section.tls_dir) != bool(section.insecure), (command, section)


@pytest.mark.integration
def test_deploy_configs_start_a_coordinator_and_a_peer(deploy_toml, procs, tmp_path, monkeypatch):
    """The containers' command lines with only the paths and ports moved to the test's sandbox."""
    import sys

    env = {"SHOAL_COORDINATOR_STATE": str(tmp_path / "coordinator.db"), "SHOAL_COORDINATOR_LISTEN": "127.0.0.1:0",
           "SHOAL_COORDINATOR_READY_FILE": str(tmp_path / "coordinator.addr"), "SHOAL_COORDINATOR_METRICS_PORT": "0",
           "SHOAL_PEER_LISTEN": "127.0.0.1:0", "SHOAL_PEER_KEY": str(tmp_path / "peer.key"),
           "SHOAL_PEER_METRICS_PORT": "0", "SHOAL_PEER_READY_FILE": str(tmp_path / "peer.addr"),
           "SHOAL_PEER_CONNECT_TIMEOUT": "30"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    coord = procs.start("coordinator", [sys.executable, "-m", "shoal.cli", "coordinator", "--config", str(deploy_toml)])
    addr = procs.wait_file(tmp_path / "coordinator.addr", 30, coord)
    monkeypatch.setenv("SHOAL_PEER_COORDINATOR", addr)
    peer = procs.start("peer", [sys.executable, "-m", "shoal.cli", "peer", "--config", str(deploy_toml)])
    procs.wait_file(tmp_path / "peer.addr", 60, peer)  # written once joined
    out = subprocess.run([sys.executable, "-m", "shoal.cli", "status", "--insecure", "--coordinator", addr, "--json"],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert '"peer_id"' in out.stdout
