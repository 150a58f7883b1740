"""deploy/: the standby-coordinator variants (compose override, Kubernetes overlay) hold together."""

from __future__ import annotations

import pathlib
import shutil
import subprocess

import pytest

yaml = pytest.importorskip("yaml", reason="PyYAML is not installed (pip install -e \".[dev]\")")

DEPLOY = pathlib.Path(__file__).resolve().parents[2] / "deploy"


def test_compose_override_adds_etcd_and_a_second_coordinator():
    exe = shutil.which("docker-compose")
    if exe is None:
        pytest.skip("docker-compose is not installed (Debian: apt-get install -y docker-compose)")
    out = subprocess.run([exe, "-f", str(DEPLOY / "docker-compose.yml"), "-f", str(DEPLOY / "docker-compose.ha.yml"),
                          "config"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    config = yaml.safe_load(out.stdout)
    services = config["services"]
    assert {"etcd", "coordinator", "coordinator-b"} <= set(services)
    for name in ("coordinator", "coordinator-b"):
        env = services[name]["environment"]
        assert env["SHOAL_COORDINATOR_STATE"] == "etcd://etcd:2379/shoal"
        assert env["SHOAL_COORDINATOR_KEY"] == "/keys/coordinator.key"  # one ticket key for both
    peers = [s for n, s in services.items() if n.startswith("peer")]
    assert len(peers) == 4 and all(p["environment"]["SHOAL_PEER_COORDINATOR"] == "coordinators:7070" for p in peers)


def test_kubernetes_overlay_runs_two_coordinators_on_etcd():
    kust = yaml.safe_load((DEPLOY / "k8s" / "ha" / "kustomization.yaml").read_text())
    assert "../" in kust["resources"] and "etcd.yaml" in kust["resources"]
    patch = yaml.safe_load((DEPLOY / "k8s" / "ha" / "coordinator-ha.yaml").read_text())
    assert patch["spec"]["replicas"] == 2
    env = {e["name"]: e["value"] for e in patch["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["SHOAL_COORDINATOR_STATE"].startswith("etcd://shoal-etcd:2379/")
    kinds = [d["kind"] for d in yaml.safe_load_all((DEPLOY / "k8s" / "ha" / "etcd.yaml").read_text())]
    assert kinds == ["Service", "StatefulSet"]
