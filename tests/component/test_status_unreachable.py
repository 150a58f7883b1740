"""`shoal status` against a loopback port nobody listens on: exit code 3 (unavailable)."""

from __future__ import annotations

from shoal import cli


def test_status_exit_code_3_when_unreachable():
    from shoal.testbeds.swarm import free_port

    assert cli.main(["status", "--insecure", "--coordinator", f"127.0.0.1:{free_port()}", "--timeout", "1"]) == \
        cli.EXIT_UNAVAILABLE
