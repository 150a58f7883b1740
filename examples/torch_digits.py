"""A PyTorch training loop that trains with a Shoal swarm (DiLoCo or FedAvg) on the digits data.

Run the whole thing locally (a coordinator and N peer processes on 127.0.0.1):

    python examples/torch_digits.py --peers 3 --rounds 12 --inner-steps 25

or one peer against a coordinator elsewhere (start it with `shoal coordinator --algorithm diloco`):

    python examples/torch_digits.py worker --coordinator HOST:7070 --data-shard 0 --num-data-shards 3

The only Shoal-specific lines of the worker are the optimizer (`shoal.torch`) and the
`opt.finished` loop condition (see `train`). Every peer builds its model after
`torch.manual_seed(seed)`; with `--different-seeds` peer i seeds with seed + i, and round 0
starts every peer from the first ready peer's parameters anyway (the coordinator's step-0 sync).
The launcher prints (and with --json writes) every peer's held-out accuracy and the digest of
its final parameters; exit code 0 when every peer finished. The local demo is plaintext on
loopback (`insecure=True`); against a TLS coordinator pass `--tls-dir DIR` (and the token in
$SHOAL_JOIN_TOKEN).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def make_model():
    import torch

    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))


def accuracy(model, x, y) -> float:
    import torch

    with torch.no_grad():
        return float((model(x).argmax(dim=1) == y).float().mean())


def train(a: argparse.Namespace) -> dict:
    """One peer: an ordinary PyTorch loop plus the swarm optimizer wrapper."""
    import torch

    import hashlib

    import shoal.torch
    from shoal.peer.workloads.digits import load_digits_split, partition

    torch.set_num_threads(1)
    train_set, test_set = load_digits_split(a.seed)
    mine = partition(train_set, a.num_data_shards, a.data_shard, seed=a.seed)
    x, y = torch.from_numpy(mine.x), torch.from_numpy(mine.y)
    x_test, y_test = torch.from_numpy(test_set.x), torch.from_numpy(test_set.y)

    torch.manual_seed(a.seed + (a.data_shard if a.different_seeds else 0))
    model = make_model()
    probe = make_model()  # evaluates committed parameters for the events/metrics, off the training model

    def evaluate(params) -> float:
        shoal.torch.unflatten_into(probe, params)
        return accuracy(probe, x_test, y_test)

    inner = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.0)
    wrapper = shoal.torch.DiLoCoOptimizer if a.algorithm == "diloco" else shoal.torch.FedAvgOptimizer
    opt = wrapper(model, inner, coordinator=a.coordinator, inner_steps=a.inner_steps, num_samples=len(mine),
                  tls_dir=a.tls_dir, insecure=a.tls_dir is None, key_path=a.key, evaluate=evaluate,
                  events_path=a.events)
    gen = torch.Generator().manual_seed(1000 + a.data_shard)
    loss_fn = torch.nn.CrossEntropyLoss()
    t0 = time.monotonic()
    with opt:
        while not opt.finished:
            idx = torch.randint(0, len(mine), (a.batch_size,), generator=gen)
            loss = loss_fn(model(x[idx]), y[idx])
            loss.backward()
            opt.step(loss=loss.item())
            opt.zero_grad()
    result = {"data_shard": a.data_shard, "rounds": opt.committed_rounds, "test_accuracy": accuracy(model, x_test, y_test),
              "seconds": round(time.monotonic() - t0, 2), "peer": opt.agent.peer_id,
              "params_digest": hashlib.blake2b(shoal.torch.flatten(model).tobytes(), digest_size=16).hexdigest()}
    if a.out:
        pathlib.Path(a.out).write_text(json.dumps(result))
    return result


def launch(a: argparse.Namespace) -> int:
    """Coordinator + `a.peers` workers as processes; every process is stopped at the end."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    procs: list[subprocess.Popen] = []
    with tempfile.TemporaryDirectory(prefix="shoal-torch-digits-") as tmp:
        wd = pathlib.Path(tmp)

        def start(argv: list[str], name: str) -> subprocess.Popen:
            log = open(wd / f"{name}.log", "wb")
            p = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                 cwd=ROOT, start_new_session=True)
            log.close()
            procs.append(p)
            return p

        try:
            start([sys.executable, "-m", "shoal.cli", "coordinator", "--listen", "127.0.0.1:0",
                   "--state", str(wd / "coordinator.db"), "--ready-file", str(wd / "coordinator.addr"),
                   "--rounds", str(a.rounds), "--min-peers", str(a.peers), "--initial-peers", str(a.peers),
                   "--algorithm", a.algorithm, "--inner-steps", str(a.inner_steps), "--num-data-shards", str(a.peers),
                   "--insecure"],  # loopback demo; see docs/security.md for TLS
                  "coordinator")
            end = time.monotonic() + 30
            while not (wd / "coordinator.addr").exists():
                if time.monotonic() > end or procs[0].poll() is not None:
                    raise RuntimeError("coordinator did not start:\n" + (wd / "coordinator.log").read_text())
                time.sleep(0.05)
            address = (wd / "coordinator.addr").read_text().strip()
            for i in range(a.peers):
                start([sys.executable, __file__, "worker", "--coordinator", address, "--data-shard", str(i),
                       "--num-data-shards", str(a.peers), "--algorithm", a.algorithm, "--inner-steps", str(a.inner_steps),
                       "--lr", str(a.lr), "--seed", str(a.seed), "--out", str(wd / f"peer-{i}.json"),
                       "--events", str(wd / f"peer-{i}.jsonl"), "--key", str(wd / f"peer-{i}.key")]
                      + (["--different-seeds"] if a.different_seeds else []), f"peer-{i}")
            end = time.monotonic() + a.timeout
            workers = procs[1:]
            while any(p.poll() is None for p in workers):
                if time.monotonic() > end:
                    raise RuntimeError(f"workers did not finish within {a.timeout:.0f}s")
                bad = [p for p in workers if p.poll() not in (None, 0)]
                if bad:
                    i = workers.index(bad[0])
                    raise RuntimeError(f"peer-{i} failed:\n" + (wd / f"peer-{i}.log").read_text()[-3000:])
                time.sleep(0.1)
            results = [json.loads((wd / f"peer-{i}.json").read_text()) for i in range(a.peers)]
            for i, r in enumerate(results):  # the committed state's digest after each round, per peer
                events = [json.loads(line) for line in (wd / f"peer-{i}.jsonl").read_text().splitlines()]
                r["commit_digests"] = {e["round"]: e["state_digest"] for e in events if e["event"] == "commit"}
                r["round0_participants"] = next((len(e["participants"]) if isinstance(e["participants"], list)
                                                 else e["participants"] for e in events
                                                 if e["event"] == "commit" and e["round"] == 0), 0)
        finally:
            for p in procs:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGTERM)
            for p in procs:
                try:
                    p.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(p.pid, signal.SIGKILL)
                    p.wait(timeout=5)
    accs = [r["test_accuracy"] for r in results]
    summary = {"peers": a.peers, "rounds": a.rounds, "algorithm": a.algorithm, "inner_steps": a.inner_steps,
               "test_accuracy_min": min(accs), "test_accuracy_mean": sum(accs) / len(accs), "per_peer": results}
    print(json.dumps(summary, indent=2))
    if a.json:
        pathlib.Path(a.json).write_text(json.dumps(summary, indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    missing = [m for m in ('torch',) if importlib.util.find_spec(m) is None]
    if missing:
        print(f"{pathlib.Path(__file__).name} needs {' and '.join(missing)}: pip install -e \".[torch]\"",
              file=sys.stderr)
        return 2
    worker = bool(argv) and argv[0] == "worker"
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--algorithm", default="diloco", choices=["diloco", "fedavg"])
    p.add_argument("--inner-steps", type=int, default=25)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--different-seeds", action="store_true", help="peer i seeds its model with seed + i")
    if worker:
        p.add_argument("--coordinator", required=True)
        p.add_argument("--data-shard", type=int, default=0)
        p.add_argument("--num-data-shards", type=int, default=1)
        p.add_argument("--batch-size", type=int, default=32)
        p.add_argument("--out")
        p.add_argument("--events")
        p.add_argument("--key", help="identity key file (default: the CLI's ~/.local/share/shoal/peer-N.key)")
        p.add_argument("--tls-dir", help="a directory holding the coordinator's ca.pem (default: plaintext)")
        a = p.parse_args(argv[1:])
        import logging

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        print(json.dumps(train(a)))
        return 0
    p.add_argument("--peers", type=int, default=3)
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--json", help="write the summary here")
    return launch(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
