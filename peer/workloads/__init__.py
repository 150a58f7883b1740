"""What a peer trains, one module per workload.

- `shoal.peer.workloads.base`: the `Workload` protocol the agent drives, and `ArrayWorkload` (the
  all-reduce job's, which trains nothing).
- `shoal.peer.workloads.digits`: the default workload, a numpy MLP on the UCI digits.
- `shoal.peer.workloads.lm`: the byte-level transformer language model (needs PyTorch).
"""
