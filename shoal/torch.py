"""Train your own PyTorch model with a Shoal swarm: `DiLoCoOptimizer` and `FedAvgOptimizer`.

The public PyTorch API (`pip install 'shoal[torch]'`). An optimizer here is a real
`torch.optim.Optimizer` wrapping your inner optimizer: every `inner_steps` calls of `step()` it
plays one round (the swarm all-reduces the pseudo-gradients, committed - local, float32; an outer
optimizer applies the mean, bit-identical on every peer) and loads the committed parameters into
the model. It is responsible for the trainer's side of a round; who takes part, when a round
opens and how tensors travel are the coordinator's and the peer agent's (docs/concepts.md).

    import torch
    import shoal.torch

    model = Net()                                    # any seed: round 0 starts every peer from one state
    inner = torch.optim.AdamW(model.parameters(), lr=3e-3)
    opt = shoal.torch.DiLoCoOptimizer(model, inner, coordinator="coord.example.org:7070",
                                      tls_dir="alice", inner_steps=25)   # token: $SHOAL_JOIN_TOKEN
    with opt:
        while not opt.finished:
            loss = loss_fn(model(x), y); loss.backward()
            opt.step(loss=loss.item()); opt.zero_grad()

`examples/torch_digits.py` (an MLP) and `examples/hf_causal_lm.py` (a Hugging Face GPT-2-style
causal LM) run it end to end; docs/training.md has the guide below with figures.

Failure semantics (every method's docstring adds its own):
- The constructor joins (bounded by `join_timeout`): SwarmError when the coordinator refuses or
  cannot be reached, ValueError on bad arguments (one line saying what to pass).
- A round that aborts is retried by the swarm; `step()` keeps waiting, up to `round_timeout`
  (RoundTimeout: the round stays in flight). Left out of a committed round, or joining a running
  swarm, the trainer downloads the committed state: the model is set to it and that phase's local
  work is dropped (the inner optimizer's state is kept).
- Round 0: peers whose models differ (other seeds) are synced to the round-0 state of the first
  peer ready, verified by its digest; their first local phase is dropped.
- The coordinator finishes the run: `finished` becomes True, the model holds the last committed
  parameters, later `step()` calls only run the inner optimizer.
- The agent fails: the next `step()` raises SwarmError; the model keeps its last committed
  parameters. `close()` (or leaving the `with` block) leaves the swarm.

Configuration guide (setting: what you observe, what to do):
- `tls_dir` / `insecure`: neither given, the constructor raises "pass tls_dir=DIR ... or
  insecure=True"; `insecure=True` warns once (InsecureWarning). Give the directory holding the
  coordinator's ca.pem.
- `join_token` (default `$SHOAL_JOIN_TOKEN`): SwarmError "... PERMISSION_DENIED ... join_token"
  at the first join of a key the coordinator does not know; later joins of that key need none.
- `key_path` / `name`: `shoal member list` shows a new member at every start when each start
  uses another key; the default (the CLI's `~/.local/share/shoal/peer-NAME.key`) keeps one.
  SwarmError "key file ... in use": another process holds it; give each trainer its own `name`.
- `listen` / `advertise`: the coordinator logs, and this trainer warns, "cannot reach this
  peer's data address": it takes part outbound-only (owns no shard). Across hosts listen on
  "0.0.0.0:PORT" (and `advertise` behind NAT), or pass `outbound_only` / `relay` (docs/nat.md).
- `inner_steps` (H): fewer rounds and bytes with a larger H, more drift between peers; None
  takes the coordinator's. Rounds per second fall when H x step time is below the all-reduce time.
- `round_timeout`: a swarm that stalls (peers gone, min_peers not reached) raises RoundTimeout
  after that long instead of blocking; None waits (the coordinator's own timeouts bound it).
- `outer_optimizer`: your torch optimizer over `model.parameters()` instead of the coordinator's
  `[run] outer`; every peer must pass the same one, else rounds abort with "digest mismatch".
- LR schedulers attach to the optimizer itself (its `param_groups` are the inner optimizer's):
  step one per `opt.step()` for a schedule over inner steps (`local_step`), or key a
  `LambdaLR` on `opt.committed_rounds` for one over rounds (the same on every peer).
- `state_dict()` / `load_state_dict()`: the inner state, the counters and the committed state;
  with `checkpoint_dir` (a **peer_config field) the agent also writes durable checkpoints of the
  committed state and resumes from them (docs/checkpoints.md).
- Devices: a model on CUDA (or MPS) is gathered into one pinned host buffer, allocated once.
"""

from __future__ import annotations

from shoal.peer.torch_optimizer import (DiLoCoOptimizer, FedAvgOptimizer, HostBuffer, InsecureWarning, RoundTimeout,
                                        SwarmError, SwarmOptimizer, TorchOuter, flatten, layout_of, unflatten_into)

__all__ = [
    "DiLoCoOptimizer",
    "FedAvgOptimizer",
    "HostBuffer",
    "InsecureWarning",
    "RoundTimeout",
    "SwarmError",
    "SwarmOptimizer",
    "TorchOuter",
    "flatten",
    "layout_of",
    "unflatten_into",
]
