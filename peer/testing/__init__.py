"""Fault injection for tests: nothing here acts unless a test or an operator asks for it.

- `shoal.peer.testing.faults`: a peer kills, stops or drops at a named point (`SHOAL_FAULT`).
- `shoal.peer.testing.byzantine`: forged contributions (`shoal peer --attack NAME`).

The agent and the data plane call their hooks, which are no-ops without `SHOAL_FAULT` or
`--attack`.
"""
