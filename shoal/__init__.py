"""Shoal: fault-tolerant decentralized training over the public internet.

The distribution holds three packages: `coordinator` (control-plane daemon), `peer` (the agent
and library a volunteer installs) and `shoal` (the `shoal` command, the local swarm, and the
generated wire code in `shoal.v1`). `peer` never imports `coordinator`.
"""

__version__ = "0.3.0"
