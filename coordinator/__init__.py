"""The Shoal coordinator: membership, leases, rounds, planning and durable state.

It never touches tensor payloads: those travel peer to peer (see `peer.collectives`).
"""
