"""deploy/: the compose file validates and declares health, published ports and image by
environment; the image is pinned, layered and non-root; Prometheus scrapes every service; the
Kubernetes manifests match the API schema."""

from __future__ import annotations

import pathlib
import re

import pytest

from kits.deploy import deploy_toml, k8s_shoal_toml  # noqa: F401 (fixture)

ROOT = pathlib.Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"


def test_prometheus_scrapes_the_coordinator_and_every_peer():
    text = (DEPLOY / "prometheus.yml").read_text()
    for target in ("coordinator:9100", "peer1:9100", "peer2:9100", "peer3:9100", "peer4:9100"):
        assert target in text


def test_dockerfile_is_slim_pinned_layered_and_non_root():
    text = (DEPLOY / "Dockerfile").read_text()
    lines = [line.strip() for line in text.splitlines()]
    # The base: a fully qualified, versioned python slim image (never a floating `latest`).
    default = next(line.split("=", 1)[1] for line in lines if line.startswith("ARG PYTHON_IMAGE="))
    assert re.fullmatch(r"docker\.io/library/python:3\.\d+(\.\d+)?-slim(-\w+)?(@sha256:[0-9a-f]{64})?", default), default
    assert "FROM ${PYTHON_IMAGE}" in lines
    # The dependencies are installed from pyproject.toml alone, before any source is copied, and
    # the package goes in afterwards without them (a code change must not reinstall everything).
    deps = next(i for i, line in enumerate(lines) if "pip install -r" in line)
    first_source = min(i for i, line in enumerate(lines) if re.match(r"COPY (shoal|peer|coordinator|protos) ", line))
    assert all(not line.startswith("COPY") or "pyproject.toml" in line for line in lines[:deps]), lines[:deps]
    assert deps < first_source
    assert any("pip install --no-deps" in line and line.rstrip().endswith("&& rm -rf /src")
               for line in lines[first_source:])
    user = [line for line in lines if line.startswith("USER ")]
    assert user and user[-1].split()[1].split(":")[0] not in ("root", "0")


def compose_file() -> dict:
    yaml = pytest.importorskip("yaml", reason="PyYAML is not installed")
    return yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())


def test_every_compose_service_has_a_healthcheck_and_peers_wait_for_a_healthy_coordinator():
    services = compose_file()["services"]
    for name, svc in services.items():
        test = svc.get("healthcheck", {}).get("test")
        assert test and test[0] in ("CMD", "CMD-SHELL"), name  # a command: no systemd needed to run it
    for name in ("peer1", "peer2", "peer3", "peer4"):
        assert services[name]["depends_on"] == {"coordinator": {"condition": "service_healthy"},
                                                "seaweedfs": {"condition": "service_started"}}, name
    for name in ("coordinator", "peer1", "peer2", "peer3", "peer4"):
        assert services[name]["init"] is True, name  # SIGTERM reaches the process (not PID 1)


def test_compose_published_ports_and_image_come_from_the_environment():
    services = compose_file()["services"]
    published = {name: svc["ports"] for name, svc in services.items() if "ports" in svc}
    assert set(published) == {"coordinator", "prometheus", "grafana"}
    for name, ports in published.items():
        for port in ports:  # loopback only, the host port from SHOAL_COMPOSE_<SERVICE>_PORT
            assert re.fullmatch(rf"127\.0\.0\.1:\$\{{SHOAL_COMPOSE_{name.upper()}_PORT:-\d+\}}:\d+", port), port
    assert {svc["image"] for name, svc in services.items() if name in ("coordinator", "seaweedfs")
            or name.startswith("peer")} == {"${SHOAL_IMAGE:-shoal:latest}"}


def test_compose_peers_checkpoint_to_the_seaweedfs_store_with_credentials_from_the_environment():
    services = compose_file()["services"]
    weed = services["seaweedfs"]
    assert weed["entrypoint"] == ["weed"] and weed["command"][0] == "mini" and "-bucket=shoal-checkpoints" in weed["command"]
    assert "ports" not in weed  # the store is for the compose network only
    for name in ("peer1", "peer2", "peer3", "peer4"):
        env = services[name]["environment"]
        assert env["SHOAL_PEER_CHECKPOINT_URL"] == "s3://shoal-checkpoints/compose", name
        assert env["SHOAL_PEER_CHECKPOINT_DIR"].startswith("/data/"), name  # the peer's volume
        assert env["AWS_ENDPOINT_URL"] == "http://seaweedfs:8333", name
        for key, var in (("AWS_ACCESS_KEY_ID", "SHOAL_S3_ACCESS_KEY_ID"),
                         ("AWS_SECRET_ACCESS_KEY", "SHOAL_S3_SECRET_ACCESS_KEY")):
            assert env[key] == weed["environment"][key] and env[key].startswith("${" + var + ":-"), (name, key)
    # Credentials never on a command line.
    for name, svc in services.items():
        argv = " ".join(map(str, svc.get("command", []) + svc.get("entrypoint", [])))
        assert "AWS_" not in argv and "SECRET" not in argv.upper(), name


def test_the_image_carries_the_s3_client_and_the_weed_binary():
    text = (DEPLOY / "Dockerfile").read_text()
    deps = text[text.index("tomllib.load"):text.index("pip install -r")]  # the requirements of layer 1
    assert 'x["s3"]' in deps and 'x["seaweedfs"]' in deps


def k8s_resources() -> list[tuple[str, dict]]:
    yaml = pytest.importorskip("yaml", reason="PyYAML is not installed")
    return [(f.name, d) for f in sorted((DEPLOY / "k8s").glob("*.yaml")) if f.name != "kustomization.yaml"
            for d in yaml.safe_load_all(f.read_text()) if d]


def test_kubernetes_manifests_parse_and_kustomize_lists_them_all():
    yaml = pytest.importorskip("yaml", reason="PyYAML is not installed")
    kinds = [d["kind"] for _, d in k8s_resources()]
    assert {"ConfigMap", "Service", "StatefulSet"} <= set(kinds)
    listed = yaml.safe_load((DEPLOY / "k8s" / "kustomization.yaml").read_text())["resources"]
    assert sorted(listed) == sorted({name for name, _ in k8s_resources()})


# The oldest Kubernetes the manifests support (the pod-index label, docs/deploy.md) and the newest
# schema the validator ships.
K8S_VERSIONS = ("1.28.0", "latest")


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_kubernetes_manifests_match_the_api_schema(version):
    """Each resource against the Kubernetes OpenAPI schema of `version`, strictly (an unknown
    field is an error): kubernetes-validate, the schemas bundled, no cluster needed."""
    kv = pytest.importorskip("kubernetes_validate", reason='kubernetes-validate is not installed (pip install -e ".[dev]")')
    version = kv.latest_version() if version == "latest" else version
    for name, doc in k8s_resources():
        kv.validate(doc, version, strict=True)  # raises ValidationError naming the field


def test_the_schema_check_catches_a_broken_manifest():
    kv = pytest.importorskip("kubernetes_validate", reason='kubernetes-validate is not installed (pip install -e ".[dev]")')
    import copy

    doc = copy.deepcopy(next(d for _, d in k8s_resources() if d["kind"] == "StatefulSet"))
    container = doc["spec"]["template"]["spec"]["containers"][0]
    container["ports"][0]["containerPort"] = "seventy"
    with pytest.raises(kv.ValidationError):
        kv.validate(doc, kv.latest_version(), strict=True)
    del container["ports"]
    container["portz"] = []  # a misspelt field: only the strict check sees it
    with pytest.raises(kv.ValidationError):
        kv.validate(doc, kv.latest_version(), strict=True)


def test_k8s_configmap_block_is_what_yaml_reads():
    yaml = pytest.importorskip("yaml", reason="PyYAML is not installed")
    doc = yaml.safe_load((DEPLOY / "k8s" / "configmap.yaml").read_text())
    assert doc["data"]["shoal.toml"].strip() == k8s_shoal_toml().strip()


def test_deploy_configs_are_valid_for_every_command(deploy_toml):
    from shoal import config

    for command in ("coordinator", "peer"):
        cfg = config.load(str(deploy_toml), {}, command=command)
        section = getattr(cfg, command)
        # Exactly one of TLS and explicit plaintext, or the process refuses to start.
        assert bool(section.tls_dir) != bool(section.insecure), (command, section)
