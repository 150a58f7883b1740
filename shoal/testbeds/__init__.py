"""Local test beds: a whole swarm on one machine, scripted scenarios, and shaped networks.

- `shoal.testbeds.swarm`: `shoal swarm`, a coordinator and N peers as local processes.
- `shoal.testbeds.scenario`: scenario files (`shoal swarm --scenario`): per-peer links, faults
  and timed events, checked before anything starts, and the per-event summary.
- `shoal.testbeds.netbed`: Linux network namespaces behind kernel-shaped links (root only).
"""
