"""The lanes of the data plane: how a collective's chunks reach another peer.

`base.Lane` is the one interface the collectives speak to; the lanes implementing it are the
shared-memory lane (`shm`, peers on one host), the bulk TCP lane (`bulk`, peers on other hosts),
gRPC streams (`streams`, the fallback, and the only lane to outbound-only peers), the relayed lane
(`relay`, peers behind NAT reached through a relay) and an in-memory lane (`memory`, unit tests of
the algorithms without sockets).
"""
