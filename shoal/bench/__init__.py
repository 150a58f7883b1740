"""Benchmarks and the processes they run.

- `shoal.bench.allreduce`: `shoal bench allreduce`, Shoal's all-reduce against a gloo baseline.
- `shoal.bench.coordinator`: `shoal bench coordinator`, one coordinator against N simulated members.
- `shoal.bench.collective_job`: the all-reduce job process (the peer agent with no training).
- `shoal.bench.lm_job` and `shoal.bench.lm_worker`: the language-model workload of
  `shoal swarm --workload lm` seen from the swarm, its peer processes, and the synchronous
  data-parallel baseline (`--baseline ddp`).
"""
