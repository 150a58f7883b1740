"""The README's join token: `SHOAL_JOIN_TOKEN=$(shoal token create ...)`, a coordinator on that
secret, and a peer with no token flag joins."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

from kits.cli import shoal


ROOT = pathlib.Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------------------ 9: the README's join token


@pytest.mark.integration
def test_the_readme_token_flow_admits_the_peer(procs, tmp_path):
    """`export SHOAL_JOIN_TOKEN=$(shoal token create --secret join.secret ...)`, a coordinator on
    that secret, and a peer with no token flag joins."""
    secret = tmp_path / "join.secret"
    made = shoal("token", "create", "--secret", str(secret), "--ttl", "600", "--label", "alice")
    assert made.returncode == 0, made.stderr
    token = made.stdout.strip()
    assert token and "\n" not in token  # usable as $(...)
    _, addr = procs.coordinator("--join-token-secret", str(secret))
    env = {**os.environ, "SHOAL_JOIN_TOKEN": token}
    ready = tmp_path / "peer.addr"
    with open(tmp_path / "peer.log", "wb") as log:  # procs.log("peer") reads it on failure
        proc = subprocess.Popen([sys.executable, "-m", "shoal.cli", "peer", "--insecure", "--coordinator", addr,
                                 "--key", str(tmp_path / "p.key"), "--ready-file", str(ready),
                                 "--connect-timeout", "30"],
                                cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    proc.name = "peer"  # type: ignore[attr-defined]
    procs.procs.append(proc)  # killed at teardown like the others
    procs.wait_file(ready, 60, proc)  # written once joined: the coordinator admitted the token
