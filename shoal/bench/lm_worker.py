"""The processes of the language-model workload (`shoal swarm --workload lm`), run as
`python -m shoal.bench.lm_worker peer ...` and `python -m shoal.bench.lm_worker ddp ...`.

`peer`: one Shoal peer. An ordinary PyTorch loop over its data shard of the standard-library
corpus (shoal.peer.workloads.lm) with `DiLoCoOptimizer` (shoal.torch): the public API a
user's script would use. Inner steps per round, algorithm and outer optimizer come from the
coordinator's run configuration; the model shape, batch size, inner learning rate and seed from
the flags (the swarm passes the same to every peer and to the baseline). Data shard 0 evaluates
the validation loss of every committed state (below); the other peers do not, which saves three
evaluations per round; the events' `test_accuracy` field is NaN. `--speed s < 1` emulates a
slower machine: after each inner step the process sleeps `(1/s - 1)` times the step's own
compute time (documented as an emulation: the peer's CPU share is not actually reduced).

With `--result`, the peer writes when it finishes: {data_shard, rounds, steps, overlapped_steps,
compute_seconds (all its inner steps, whole: zero_grad, batch, forward, backward and the inner
optimizer's step; the emulated slowdown excluded), seconds (from joining to having left),
compute_utilization (the training window: window_compute_seconds / window_seconds, see
shoal.peer.compute_accounting.ComputeLedger), compute_utilization_lifetime (compute_seconds /
seconds), first_step_at (seconds after the start of the join), seconds_by_part (where the wall
time went: join, steps, inner_optimizer (part of steps), handover, wait, land, slowdown, leave,
other; evaluation, in its own thread)}. Data shard 0 evaluates the committed states in a
low-priority thread (`Evaluator`) and writes them to the evaluations file next to its events
(`peer-0.val.jsonl`), not into its commit events.

`ddp`: one rank of the synchronous data-parallel baseline (`--baseline ddp`): the same model
and initial parameters, rank i samples the same data shard with the same generator as peer i,
and every step the gradients are averaged with one torch.distributed gloo all-reduce (flattened
into a single float32 buffer) before the same AdamW step on every rank. Rank 0 evaluates every
`--eval-every` steps and writes JSON lines {step, t, val_loss, bytes_sent_total} to `--out`.
`bytes_sent_total` is what a bandwidth-optimal all-reduce (ring: each rank sends
2 (world-1)/world x n x 4 bytes per step) must send, a lower bound for gloo's algorithms: the
baseline is charged no more than it must send.

Exit codes: 0 done; 1 failed (the traceback is in the process's log).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import pathlib
import queue
import sys
import threading
import time

import numpy as np
import torch
import torch.distributed as dist

from shoal.common.procexit import exit_after_gloo
from shoal.common.security import Security
from shoal.peer.workloads import lm
from shoal.peer.compute_accounting import utilization
from shoal.torch import DiLoCoOptimizer, FedAvgOptimizer, unflatten_into

log = logging.getLogger("shoal.lm")


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--d-model", type=int, default=lm.LMShape.d_model)
    p.add_argument("--layers", type=int, default=lm.LMShape.layers)
    p.add_argument("--heads", type=int, default=lm.LMShape.heads)
    p.add_argument("--context", type=int, default=lm.LMShape.context)
    p.add_argument("--eval-windows", type=int, default=128)
    p.add_argument("--data-shard", type=int, default=0)
    p.add_argument("--num-data-shards", type=int, default=1)
    p.add_argument("--log-level", default="info")
    p.add_argument("--log-format", default="text")
    p.add_argument("--warm-start", default=None, help="start from these parameters (a `warm` output), not the seed's")


def parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m shoal.bench.lm_worker")
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("peer")
    _model_args(p)
    p.add_argument("--coordinator", required=True)
    p.add_argument("--listen", default="127.0.0.1:0")
    p.add_argument("--advertise", default=None)
    p.add_argument("--key", required=True)
    p.add_argument("--events", default=None)
    p.add_argument("--algorithm", default="diloco", choices=("diloco", "fedavg"))
    p.add_argument("--speed", type=float, default=1.0)
    p.add_argument("--result", default=None, help="write the result JSON (compute_seconds, seconds, ...) here")
    p.add_argument("--metrics-port", type=int, default=0)
    p.add_argument("--metrics-host", default="127.0.0.1")
    p.add_argument("--insecure", action="store_true")
    p.add_argument("--tls-dir", default=None)
    p.add_argument("--mtls", action="store_true")
    p.add_argument("--join-token", default="")
    p.add_argument("--no-shared-memory", dest="shared_memory", action="store_false",
                   help="no shared-memory lane to peers on this host (a network namespace stands for a host)")
    p.add_argument("--checkpoint-dir", default=None, help="write checkpoints of the committed state here")
    p.add_argument("--checkpoint-every", type=int, default=10)
    p.add_argument("--checkpoint-url", default=None,
                   help="the swarm's shared checkpoint store, file://DIR or s3://BUCKET/PREFIX (credentials from the "
                        "environment)")
    d = sub.add_parser("ddp")
    _model_args(d)
    d.add_argument("--world", type=int, required=True)
    d.add_argument("--init", required=True, help="torch.distributed init method: file:///PATH or tcp://HOST:PORT")
    d.add_argument("--steps", type=int, required=True)
    d.add_argument("--eval-every", type=int, required=True)
    d.add_argument("--out", default=None)
    w = sub.add_parser("warm")
    _model_args(w)
    w.add_argument("--world", type=int, required=True)
    w.add_argument("--steps", type=int, required=True)
    w.add_argument("--out", required=True)
    return ap.parse_args(argv)


def _shape(a: argparse.Namespace) -> lm.LMShape:
    return lm.LMShape(a.d_model, a.layers, a.heads, a.context)


def _model(a: argparse.Namespace) -> "lm.TinyGPT":
    """The model every peer and rank starts from: the seed's, or the `--warm-start` parameters."""
    model = lm.make_model(_shape(a), a.seed)
    if a.warm_start:
        model.load_state_dict(torch.load(a.warm_start, weights_only=True))
    return model


def run_warm(a: argparse.Namespace) -> dict:
    """`warm` (what `shoal swarm --warm-start-steps` runs, shoal.bench.lm_job.warm_start): `--steps`
    synchronous steps of the seed's model on the whole training corpus, `--world` x
    `--batch-size` windows a step (what one step of the ddp baseline computes), AdamW at `--lr`;
    writes the parameters to `--out`; returns {steps, val_loss (nats per byte)}."""
    shape = _shape(a)
    corpus = lm.load_corpus()
    model = lm.make_model(shape, a.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(a.seed * 1000 + 7)
    for _ in range(a.steps):
        x, y = lm.sample_batch(corpus.train, a.world * a.batch_size, shape.context, gen)
        model.loss(x, y).backward()
        opt.step()
        opt.zero_grad()
    model.eval()
    val = lm.evaluate_loss(model, lm.validation_windows(corpus, shape.context, a.eval_windows))
    torch.save(model.state_dict(), a.out)
    return {"steps": a.steps, "val_loss": val}


def run_peer(a: argparse.Namespace) -> dict:
    """Train as one Shoal peer until the coordinator finishes the run; returns a small result dict."""
    shape = _shape(a)
    corpus = lm.load_corpus()
    data = corpus.shard(a.data_shard, a.num_data_shards)
    windows = lm.validation_windows(corpus, shape.context, a.eval_windows)
    model = _model(a)
    probe = lm.make_model(shape, a.seed)  # evaluates committed parameters, off the training model
    probe.eval()

    evaluator = Evaluator(probe, windows, _evaluations_path(a.events)) if a.data_shard == 0 else None
    opt = None  # the optimizer, once built: it says which committed state `evaluate` is given

    def evaluate(params) -> float:
        if evaluator is not None:
            cfg = opt.run_config if opt is not None else None
            # Streaming: one evaluation per sweep over the fragments, as many as whole-model rounds.
            evaluator.every = cfg.fragments if cfg is not None else 1
            evaluator.submit(opt.committed_rounds if opt is not None else 0, params)
        return math.nan  # the value goes to the evaluations file (Evaluator), not into the commit event

    inner = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.0)
    wrapper = DiLoCoOptimizer if a.algorithm == "diloco" else FedAvgOptimizer
    security = Security(tls_dir=a.tls_dir, mtls=a.mtls, insecure=a.insecure)
    t0 = time.monotonic()
    opt = wrapper(model, inner, coordinator=a.coordinator, inner_steps=None, num_samples=len(data),
                  listen=a.listen, advertise=a.advertise, key_path=a.key, evaluate=evaluate,
                  events_path=a.events, security=security, join_token=a.join_token, data_shard=a.data_shard,
                  metrics_port=a.metrics_port, metrics_host=a.metrics_host, shared_memory=a.shared_memory,
                  checkpoint_dir=a.checkpoint_dir, checkpoint_every=a.checkpoint_every,
                  checkpoint_url=a.checkpoint_url)
    joined = time.monotonic()
    gen = torch.Generator().manual_seed(a.seed * 1000 + 17 + a.data_shard)
    slow = max(0.0, 1.0 / a.speed - 1.0)
    slept = 0.0
    with opt:
        while not opt.finished:
            s = time.monotonic()
            opt.zero_grad()  # inside the step's clock: part of the inner step
            x, y = lm.sample_batch(data, a.batch_size, shape.context, gen)
            loss = model.loss(x, y)
            loss.backward()
            spent = time.monotonic() - s
            if slow:
                time.sleep(slow * spent)  # the --peer-speed emulation (module docstring)
                slept += slow * spent
            opt.step(loss=loss.item(), samples=a.batch_size, work_seconds=spent)
        done = time.monotonic()
    evaluation = evaluator.close() if evaluator is not None else 0.0  # the last evaluations, after the run
    end = time.monotonic()
    return peer_result(a.data_shard, opt, start=t0, joined=joined, done=done, end=end, slept=slept,
                       evaluation=evaluation)


def _evaluations_path(events: str | None) -> pathlib.Path | None:
    return pathlib.Path(events).with_suffix(".val.jsonl") if events else None


class Evaluator:
    """Evaluates committed states off the round's path: the agent hands each committed state
    over (`submit`, a copy, never blocks) and one background thread at the lowest CPU priority
    (nice 19) computes its validation loss and appends {"round": index of the committed round,
    "val_loss"} to `path` (JSON lines; shoal.bench.lm_job.summary reads them). Evaluation is
    measurement, not training: run inside the agent's commit handling it held up the evaluating
    peer's next Ready, and with it every peer's round (docs/training.md). `close()` evaluates
    what is left, stops the thread and returns the seconds spent evaluating.

    Failure: an evaluation that raises (e.g. the file cannot be written) stops the thread; later
    states are not queued, and `close()` raises RuntimeError from that error (the peer's result
    would lack its validation curve)."""

    def __init__(self, probe: "lm.TinyGPT", windows, path: pathlib.Path | None):
        self.probe, self.windows, self.path = probe, windows, path
        self.todo: queue.Queue[tuple[int, np.ndarray] | None] = queue.Queue()
        self.seconds = 0.0
        self.last = -1
        self.every = 1  # evaluate states of a multiple of this many rounds (the others: only the last one, at close)
        self._skipped: tuple[int, np.ndarray] | None = None
        self.error: BaseException | None = None  # what stopped the thread
        self.thread = threading.Thread(target=self._run, name="shoal-lm-eval", daemon=True)
        self.thread.start()

    def submit(self, rounds: int, params: np.ndarray) -> None:
        """Queue the committed state of `rounds` rounds (copied); one already queued is skipped
        (the agent evaluates the final state at the end of the run once more), and so is the
        initial state (no committed round yet). With `every` > 1 (streaming: the fragments per
        sweep) a state whose round count is no multiple of it is only kept: `close` evaluates
        the newest such state when it is newer than the last evaluated one."""
        if rounds < 1 or rounds == self.last or self.error is not None:
            return
        if rounds % max(1, self.every):
            self._skipped = (rounds, np.array(params, dtype=np.float32, copy=True))
            return
        self._skipped = None
        self.last = rounds
        self.todo.put((rounds, np.array(params, dtype=np.float32, copy=True)))

    def close(self) -> float:
        """Evaluate what is queued, stop the thread; the seconds spent evaluating. Raises
        RuntimeError when an evaluation failed (class docstring)."""
        if self._skipped is not None and self._skipped[0] > self.last:
            self.last = self._skipped[0]
            self.todo.put(self._skipped)
        self.todo.put(None)
        self.thread.join()
        if self.error is not None:
            raise RuntimeError(f"evaluating committed states failed: {self.error!r}") from self.error
        return self.seconds

    def _run(self) -> None:
        try:
            self._evaluate_queued()
        except BaseException as exc:  # read by close(): no error of this thread goes unseen
            self.error = exc
            log.error("evaluating committed states failed (%s: %s); no further state is evaluated",
                      type(exc).__name__, exc)

    def _evaluate_queued(self) -> None:
        with contextlib.suppress(OSError):  # lower this thread only (Linux: a thread id is a process id)
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        out = open(self.path, "a") if self.path is not None else None
        try:
            while (item := self.todo.get()) is not None:
                rounds, params = item
                t = time.monotonic()
                unflatten_into(self.probe, params)
                val = lm.evaluate_loss(self.probe, self.windows)
                self.seconds += time.monotonic() - t
                if out is not None:
                    out.write(json.dumps({"round": rounds - 1, "val_loss": val}) + "\n")
                    out.flush()
        finally:
            if out is not None:
                out.close()


def peer_result(data_shard: int, opt, *, start: float, joined: float, done: float, end: float, slept: float,
                evaluation: float) -> dict:
    """The peer's result (module docstring) from its optimizer's accounting (`opt.times`,
    `opt.ledger`, counters) and the loop's own clock readings (monotonic seconds): `start` before
    joining, `joined` when the constructor returned, `done` when the loop saw the run finished,
    `end` after leaving; `slept` the emulated slowdown, `evaluation` the Evaluator's seconds (its own
    thread: they overlap the rest)."""
    times = opt.times
    window_compute, window = opt.ledger.window()
    wall = end - start
    first = opt.ledger.first_start
    breakdown = {"join": joined - start, **times.as_dict(), "slowdown": slept, "leave": end - done,
                 "evaluation": evaluation}
    # What the loop spent outside the wrapper's accounting and the emulation (loss.item(), the loop).
    breakdown["other"] = wall - (breakdown["join"] + times.steps + times.handover + times.wait + times.land
                                 + slept + breakdown["leave"])
    return {"data_shard": data_shard, "rounds": opt.rounds, "steps": opt.local_step,
            "overlapped_steps": opt.overlapped_steps,
            "compute_seconds": round(times.steps, 3), "seconds": round(wall, 3),
            # None: no phase of this process reached a commit (e.g. restarted late in a chaos run).
            "compute_utilization": utilization(window_compute, window) if window > 0 else None,
            "compute_utilization_lifetime": utilization(times.steps, wall),
            "window_compute_seconds": round(window_compute, 3), "window_seconds": round(window, 3),
            "first_step_at": round(first - start, 3) if first is not None else None,
            "seconds_by_part": {k: round(v, 3) for k, v in breakdown.items()}}


def run_ddp(a: argparse.Namespace) -> None:
    """One rank of the synchronous baseline (module docstring)."""
    rank, world = a.data_shard, a.world
    dist.init_process_group("gloo", init_method=a.init, rank=rank, world_size=world)
    try:
        shape = _shape(a)
        corpus = lm.load_corpus()
        data = corpus.shard(rank, world)
        windows = lm.validation_windows(corpus, shape.context, a.eval_windows) if rank == 0 else None
        model = _model(a)
        n = lm.num_params(model)
        per_step = 2 * (world - 1) * n * 4  # bytes every rank together must send, ring all-reduce
        inner = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.0)
        gen = torch.Generator().manual_seed(a.seed * 1000 + 17 + rank)
        params = list(model.parameters())
        out = open(a.out, "w") if (a.out and rank == 0) else None

        def record(step: int) -> None:
            if out is not None:
                model.eval()
                val = lm.evaluate_loss(model, windows)
                model.train()
                out.write(json.dumps({"step": step, "t": time.time(), "val_loss": val,
                                      "bytes_sent_total": per_step * step}) + "\n")
                out.flush()

        record(0)
        for step in range(1, a.steps + 1):
            x, y = lm.sample_batch(data, a.batch_size, shape.context, gen)
            model.loss(x, y).backward()
            flat = torch.cat([p.grad.reshape(-1) for p in params])
            dist.all_reduce(flat)
            flat /= world
            off = 0
            for p in params:
                p.grad.copy_(flat[off:off + p.numel()].view_as(p))
                off += p.numel()
            inner.step()
            inner.zero_grad(set_to_none=False)
            if step % a.eval_every == 0 or step == a.steps:
                record(step)
        if out is not None:
            out.close()
        dist.barrier()  # no rank tears its gloo pairs down while another still reduces
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    a = parse(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=a.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(1)  # peers share the machine's cores; one intra-op thread each
    if a.command == "peer":
        result = run_peer(a)
        log.info("finished: %s", json.dumps(result))
        if a.result:
            with open(a.result, "w") as f:
                json.dump(result, f)
    elif a.command == "warm":
        print(json.dumps(run_warm(a)))
    else:
        run_ddp(a)
        exit_after_gloo(0)  # the rank's results are written (shoal.common.procexit)
    return 0


if __name__ == "__main__":
    sys.exit(main())
