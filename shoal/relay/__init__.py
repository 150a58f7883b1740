"""The relay: a TCP relay for peers nobody can dial (docs/nat.md, "Relays").

- `shoal.relay.protocol`: the wire protocol relays and peers share (header lines, registration,
  end-to-end chunk signatures). It imports only the shared base, so the peer's side of the relay
  (`shoal.peer.lanes.relay`) and the daemon both use it.
- `shoal.relay.server`: the daemon `shoal relay` runs (`run_relay`); it never imports the peer.

This package's own module imports nothing, so importing the protocol loads no daemon code.
"""
