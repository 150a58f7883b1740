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
