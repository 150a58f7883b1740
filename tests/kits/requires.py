"""Skip markers for what a test needs from the machine, each saying what to install."""

from __future__ import annotations

import shutil

import pytest

# The NAT bed (shoal.testbeds.netbed) puts a router namespace with iptables MASQUERADE in front of
# a NATed host; `.ci/run` installs iptables.
needs_iptables = pytest.mark.skipif(shutil.which("iptables") is None,
                                    reason="iptables is not installed (apt-get install iptables): the NAT bed needs it")
