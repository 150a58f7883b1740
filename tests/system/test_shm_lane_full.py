"""The shared-memory lane (peer/lanes/shm.py): segments, checks, and all-reduces that use it.

Segments are real files in /dev/shm; the all-reduces run over real gRPC streams on loopback in
this event loop, with real Ed25519 identities and coordinator-signed tickets.
"""

from __future__ import annotations

import os

import pytest

from shoal.peer.lanes import shm

pytestmark = pytest.mark.skipif(not shm.available(), reason="no writable /dev/shm on this machine")

# Per test process (the slab names' 16-hex prefix): parallel test workers share /dev/shm.


def _private_tmpfs_works() -> bool:
    """Whether `unshare -m` can mount a private tmpfs over /dev/shm here (root, CAP_SYS_ADMIN)."""
    import shutil
    import subprocess

    if os.geteuid() != 0 or not shutil.which("unshare"):
        return False
    probe = subprocess.run(["unshare", "-m", "sh", "-c", f"mount -t tmpfs -o size=1m tmpfs {shm.SHM_DIR}"],
                           capture_output=True, timeout=30)
    return probe.returncode == 0


@pytest.mark.integration
def test_a_full_dev_shm_falls_back_to_the_socket_instead_of_crashing(tmp_path):
    # A 1 MiB tmpfs in a private mount namespace (Docker's /dev/shm is 64 MB): the first slab
    # fits, the next ones do not; posix_fallocate says ENOSPC and the streams continue inline.
    # Probed here, not in a skipif: the probe starts a process, which collection must not.
    if not _private_tmpfs_works():
        pytest.skip("needs root and unshare(1) with mount rights to mount a tiny private /dev/shm")
    import subprocess
    import sys
    import textwrap

    script = tmp_path / "small_shm.py"
    script.write_text(textwrap.dedent("""
        import asyncio, os, sys
        sys.path[:0] = [sys.argv[1], os.path.join(sys.argv[1], "tests")]
        import numpy as np
        from kits.swarmlet import Swarmlet

        async def main():
            n = 1_000_000  # 4 MB per peer
            xs = [np.full(n, i + 1, dtype=np.float32) for i in range(2)]
            async with Swarmlet(2, [True, True]) as peers:
                res = await peers.run(xs, attempt=0, algorithm="butterfly", chunk_bytes=256 << 10)
                lanes = [t.lanes() for t in peers.transports]
            assert all(np.array_equal(r.values, np.full(n, 3, np.float32)) for r in res), "wrong sum"
            print("LANES", sorted(v for l in lanes for v in l.values()))

        asyncio.run(main())
    """))
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    cmd = f"mount -t tmpfs -o size=1m tmpfs {shm.SHM_DIR} && exec {sys.executable} {script} {root}"
    out = subprocess.run(["unshare", "-m", "sh", "-c", cmd], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "LANES ['socket', 'socket']" in out.stdout, out.stdout + out.stderr[-2000:]
    assert "shared-memory lane to" in out.stderr and "No space left" in out.stderr, out.stderr[-2000:]
