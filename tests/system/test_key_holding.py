"""Key files across processes: a key file is held by one process at a time, and the per-user
default keys live in the user data directory, one per name, port or free slot."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from shoal.common.identity import KeyInUse, hold_default_key, hold_key, peer_key_path

KEY_A, KEY_B = b"\x01" * 32, b"\x02" * 32


# ------------------------------------------------------------------------------ key files


def test_a_key_file_is_held_by_one_process(tmp_path):
    path = tmp_path / "p.key"
    held = hold_key(path)
    assert hold_key(path) is held  # twice in one process: the same hold
    code = textwrap.dedent(f"""
        from shoal.common.identity import KeyInUse, hold_key
        try:
            hold_key({str(path)!r})
        except KeyInUse as exc:
            print(exc)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert f"key file {path} (peer {held.peer_id}) is in use by another process" in out.stdout, out


def test_default_keys_live_in_the_user_data_dir_one_per_name_port_or_free_slot(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    assert peer_key_path("alice") == tmp_path / "shoal" / "peer-alice.key"
    assert hold_default_key("alice", 0).path == tmp_path / "shoal" / "peer-alice.key"
    assert hold_default_key(None, 7071).path == tmp_path / "shoal" / "peer-7071.key"
    first = hold_default_key(None, 0)
    assert first.path.name == "peer-1.key"
    with pytest.raises(ValueError):
        peer_key_path("../x")
    # Another process takes the next free slot: two peers, two identities.
    code = "from shoal.common.identity import hold_default_key as h; k = h(None, 0); print(k.path.name, k.peer_id)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "XDG_DATA_HOME": str(tmp_path)})
    name, pid = out.stdout.split()
    assert name == "peer-2.key" and pid != first.peer_id, out
    # A name held by another process is refused, not replaced by another key.
    child = subprocess.Popen([sys.executable, "-c", "import time; from shoal.common.identity import hold_default_key "
                              "as h; h('bob', 0); print('held', flush=True); time.sleep(60)"],
                             stdout=subprocess.PIPE, text=True, env={**os.environ, "XDG_DATA_HOME": str(tmp_path)})
    try:
        assert child.stdout.readline().strip() == "held"
        with pytest.raises(KeyInUse, match="peer-bob.key"):
            hold_default_key("bob", 0)
    finally:
        child.kill()
        child.wait(timeout=30)


# ------------------------------------------------------------------------------ diagnosis


# The details grpcio 1.6x gives for each failure (recorded on this machine).
