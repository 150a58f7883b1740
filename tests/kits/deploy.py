"""The deploy/ files as the tests read them: the TOML the Kubernetes ConfigMap embeds, and a
fixture giving each deployment's shoal.toml (compose's file, the ConfigMap's block)."""

from __future__ import annotations

import pathlib

import pytest

DEPLOY = pathlib.Path(__file__).resolve().parents[2] / "deploy"


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


@pytest.fixture(params=["compose", "k8s"])
def deploy_toml(request, tmp_path) -> pathlib.Path:
    """deploy/shoal.toml (compose), and the ConfigMap's block written to a file (k8s)."""
    if request.param == "compose":
        return DEPLOY / "shoal.toml"
    path = tmp_path / "k8s-shoal.toml"
    path.write_text(k8s_shoal_toml())
    return path
