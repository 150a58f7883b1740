"""A Hugging Face causal LM trained with `shoal.torch.DiLoCoOptimizer`, against one process.

    pip install -e ".[torch,hf]"          # or: pip install transformers
    python examples/hf_causal_lm.py --peers 3 --rounds 8 --inner-steps 20

The model is `transformers.GPT2LMHeadModel` built from a `GPT2Config` (nothing is downloaded):
byte-level (vocabulary 256), context 64, 4 layers, 4 heads, width 192, no dropout:
1.85 M parameters. The text is the Python standard library's own source that ships with every
Python (`shoal.peer.workloads.lm.load_corpus`: every 10th file held out for validation). The
launcher starts a coordinator and `--peers` worker processes on 127.0.0.1 (plaintext on
loopback, `insecure=True`); each worker is an ordinary PyTorch loop (batch, forward,
`loss.backward()`, `opt.step()`, `opt.zero_grad()`) on its own data shard around
`shoal.torch.DiLoCoOptimizer` (AdamW inside, the coordinator's Nesterov outer step). Then, in the
launcher, the same model from the same initial parameters trains in a single process for the
same number of steps (`rounds x inner_steps`) on the batches of all peers together (`--peers`
x `--batch-size` windows a step: the same data and compute as the swarm, synchronous). Both
are evaluated on the same 128 held-out windows; the summary (stdout, `--json FILE`) holds the
initial and final validation losses (nats per byte) and their ratio.

One peer against a coordinator elsewhere (started with `--algorithm diloco`):

    python examples/hf_causal_lm.py worker --coordinator HOST:7070 --tls-dir DIR --data-shard 0 --num-data-shards 3
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


def make_model(a: argparse.Namespace):
    """A GPT-2-style causal LM from a config (random initial weights, seeded by the caller)."""
    try:
        import transformers
    except ImportError:
        sys.exit("hf_causal_lm.py needs transformers: pip install transformers (or pip install -e '.[hf]')")
    cfg = transformers.GPT2Config(vocab_size=256, n_positions=a.context, n_embd=a.width, n_layer=a.layers,
                                  n_head=a.heads, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                  bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg)


def lm_loss(model, x, y):
    """Mean cross-entropy per byte (nats): x, y (batch, context) int64, y shifted by one byte."""
    import torch

    logits = model(input_ids=x).logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def val_loss(model, windows) -> float:
    import torch

    model.eval()
    with torch.no_grad():
        out = float(lm_loss(model, *windows))
    model.train()
    return out


def data(a: argparse.Namespace):
    from shoal.peer.workloads import lm

    corpus = lm.load_corpus()
    return corpus, lm.validation_windows(corpus, a.context, count=128)


def train(a: argparse.Namespace) -> dict:
    """One peer: an ordinary PyTorch loop around the swarm optimizer."""
    import torch

    import shoal.torch
    from shoal.peer.workloads import lm

    torch.set_num_threads(1)
    corpus, windows = data(a)
    shard = corpus.shard(a.data_shard, a.num_data_shards)
    torch.manual_seed(a.seed + (a.data_shard if a.different_seeds else 0))
    model = make_model(a)
    if a.init:
        model.load_state_dict(torch.load(a.init))
    inner = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.0)
    opt = shoal.torch.DiLoCoOptimizer(model, inner, coordinator=a.coordinator, tls_dir=a.tls_dir,
                                      insecure=a.tls_dir is None, key_path=a.key, events_path=a.events)
    initial = val_loss(model, windows)  # the round-0 state every peer starts from
    gen = torch.Generator().manual_seed(1000 + a.data_shard)
    t0 = time.monotonic()
    with opt:
        while not opt.finished:
            x, y = lm.sample_batch(shard, a.batch_size, a.context, gen)
            loss = lm_loss(model, x, y)
            loss.backward()
            opt.step(loss=loss.item())
            opt.zero_grad()
    result = {"data_shard": a.data_shard, "rounds": opt.committed_rounds, "local_steps": opt.local_step,
              "val_loss_initial": initial, "val_loss": val_loss(model, windows),
              "seconds": round(time.monotonic() - t0, 1),
              "params": sum(p.numel() for p in model.parameters())}
    if a.out:
        pathlib.Path(a.out).write_text(json.dumps(result))
    return result


def single_process(a: argparse.Namespace, steps: int, *, init: pathlib.Path | None = None,
                   save: pathlib.Path | None = None, data_seed: int = 1000) -> dict:
    """The same model from the same initial parameters (`init`, else the seed's), `steps` steps on
    every peer's batch together, in this process; `save`: write its parameters there."""
    import torch

    from shoal.peer.workloads import lm

    torch.set_num_threads(1)
    corpus, windows = data(a)
    shards = [corpus.shard(i, a.peers) for i in range(a.peers)]
    torch.manual_seed(a.seed)
    model = make_model(a)
    if init is not None:
        model.load_state_dict(torch.load(init))
    inner = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.0)
    gens = [torch.Generator().manual_seed(data_seed + i) for i in range(a.peers)]
    initial = val_loss(model, windows)
    t0 = time.monotonic()
    for _ in range(steps):
        batches = [lm.sample_batch(s, a.batch_size, a.context, g) for s, g in zip(shards, gens)]
        x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
        lm_loss(model, x, y).backward()
        inner.step()
        inner.zero_grad()
    if save is not None:
        torch.save(model.state_dict(), save)
    return {"steps": steps, "batch": a.peers * a.batch_size, "val_loss_initial": initial,
            "val_loss": val_loss(model, windows), "seconds": round(time.monotonic() - t0, 1)}


def launch(a: argparse.Namespace) -> int:
    """Coordinator + `a.peers` workers as processes (every one stopped at the end), then the
    single-process run."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    procs: list[subprocess.Popen] = []
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="shoal-hf-lm-") as tmp:
        wd = pathlib.Path(tmp)
        init = wd / "warm.pt" if a.warm_start_steps else None
        warm = single_process(a, a.warm_start_steps, save=init, data_seed=5000) if init is not None else None

        def start(argv: list[str], name: str) -> subprocess.Popen:
            with open(wd / f"{name}.log", "wb") as log:
                p = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                     cwd=ROOT, start_new_session=True)
            procs.append(p)
            return p

        try:
            start([sys.executable, "-m", "shoal.cli", "coordinator", "--listen", "127.0.0.1:0",
                   "--state", str(wd / "coordinator.db"), "--ready-file", str(wd / "coordinator.addr"),
                   "--rounds", str(a.rounds), "--min-peers", str(a.peers), "--initial-peers", str(a.peers),
                   "--algorithm", "diloco", "--inner-steps", str(a.inner_steps), "--num-data-shards", str(a.peers),
                   "--finish-linger", "30", "--insecure"], "coordinator")
            end = time.monotonic() + 30
            while not (wd / "coordinator.addr").exists():
                if time.monotonic() > end or procs[0].poll() is not None:
                    raise RuntimeError("coordinator did not start:\n" + (wd / "coordinator.log").read_text())
                time.sleep(0.05)
            address = (wd / "coordinator.addr").read_text().strip()
            for i in range(a.peers):
                start([sys.executable, __file__, "worker", "--coordinator", address, "--data-shard", str(i),
                       "--num-data-shards", str(a.peers), *_model_flags(a), "--out", str(wd / f"peer-{i}.json"),
                       "--events", str(wd / f"peer-{i}.jsonl"), "--key", str(wd / f"peer-{i}.key")]
                      + (["--init", str(init)] if init is not None else [])
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
                time.sleep(0.2)
            peers = [json.loads((wd / f"peer-{i}.json").read_text()) for i in range(a.peers)]
            swarm_seconds = round(time.monotonic() - t0, 1)
            single = single_process(a, a.rounds * a.inner_steps, init=init)
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
    swarm_loss = max(p["val_loss"] for p in peers)
    summary = {"peers": a.peers, "rounds": a.rounds, "inner_steps": a.inner_steps, "batch_size": a.batch_size,
               "params": peers[0]["params"], "warm_start_steps": a.warm_start_steps,
               "warm_start_val_loss": warm["val_loss"] if warm else None, "swarm_val_loss_initial": peers[0]["val_loss_initial"],
               "swarm_val_loss": swarm_loss, "swarm_seconds": swarm_seconds,
               "single_val_loss_initial": single["val_loss_initial"], "single_val_loss": single["val_loss"],
               "single_seconds": single["seconds"], "val_loss_ratio": round(swarm_loss / single["val_loss"], 4),
               "per_peer": peers}
    print(json.dumps(summary, indent=2))
    if a.json:
        pathlib.Path(a.json).write_text(json.dumps(summary, indent=2))
    return 0


def _model_flags(a: argparse.Namespace) -> list[str]:
    return ["--inner-steps", str(a.inner_steps), "--lr", str(a.lr), "--seed", str(a.seed), "--batch-size",
            str(a.batch_size), "--context", str(a.context), "--width", str(a.width), "--layers", str(a.layers),
            "--heads", str(a.heads)]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    missing = [m for m in ('torch', 'transformers') if importlib.util.find_spec(m) is None]
    if missing:
        print(f"{pathlib.Path(__file__).name} needs {' and '.join(missing)}: pip install -e \".[hf]\"",
              file=sys.stderr)
        return 2
    worker = bool(argv) and argv[0] == "worker"
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--inner-steps", type=int, default=20)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--different-seeds", action="store_true", help="peer i seeds its model with seed + i")
    p.add_argument("--batch-size", type=int, default=8, help="windows per step and peer")
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--width", type=int, default=192)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--init", help="initial parameters (a state_dict file; default: the seed's)")
    if worker:
        p.add_argument("--coordinator", required=True)
        p.add_argument("--tls-dir", help="a directory holding the coordinator's ca.pem (default: plaintext)")
        p.add_argument("--key", help="identity key file (default: the CLI's ~/.local/share/shoal/peer-N.key)")
        p.add_argument("--data-shard", type=int, default=0)
        p.add_argument("--num-data-shards", type=int, default=1)
        p.add_argument("--out")
        p.add_argument("--events")
        a = p.parse_args(argv[1:])
        import logging

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        print(json.dumps(train(a)))
        return 0
    p.add_argument("--peers", type=int, default=3)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--warm-start-steps", type=int, default=0,
                   help="first train this many steps in one process (every peer's batch together); swarm and "
                        "single process both start from there")
    p.add_argument("--timeout", type=float, default=1200.0)
    p.add_argument("--json", help="write the summary here")
    return launch(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
