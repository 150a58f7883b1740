"""The language-model workload of `shoal swarm --workload lm`, seen from the swarm (no torch here).

- `LMSettings`: the model shape and inner-loop settings given to every peer and to the baseline.
- `peer_argv`: the command line of one LM peer (`python -m shoal.bench.lm_worker peer`, the
  DiLoCoOptimizer loop), from the swarm's own peer arguments.
- `summary`: the summary keys of the LM run from the peers' events: `val_loss` (mean
  cross-entropy per byte, nats, on the fixed held-out windows of shoal.peer.workloads.lm),
  `val_bits_per_byte`, and `val_curve` (per committed round: seconds since the swarm started,
  bytes sent by all peers so far, val_loss).
- `run_ddp_baseline`: `--baseline ddp`, the synchronous data-parallel baseline (gloo all-reduce
  of gradients every step, shoal.bench.lm_worker ddp), run after the swarm on the same machine with the
  same peers' data shards, the same total number of optimizer steps (rounds x inner steps) and
  the same per-rank batch; returns the `baseline_*` keys.

Failure semantics: the baseline's processes are bounded by `timeout` and killed (process
groups) on every exit path; a failed or timed-out baseline raises RuntimeError with the tail
of rank 0's log.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import pathlib
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

from shoal.processes import ProcessGroup

NEEDS_TORCH = 'needs PyTorch: pip install -e ".[torch]"'

# The coordinator stays up this long after the run finished and its members left or went
# silent: a peer still in the middle of its local update of the round after the last one
# (LM rounds take tens of seconds) must still find it, to be told the run finished, instead of
# retrying its Ready against a closed port until its connect timeout.
COORDINATOR_ARGS = ("--finish-linger", "300")


def torch_available() -> bool:
    """PyTorch can be imported (checked without importing it)."""
    try:
        return importlib.util.find_spec("torch") is not None
    except ValueError:  # sys.modules["torch"] is None: its import is blocked
        return False


@dataclass(frozen=True)
class LMSettings:
    """Model shape (d_model, layers, heads, context bytes), per-peer batch (windows per inner
    step), inner AdamW learning rate, validation windows, seed. The defaults are the measured
    configuration of docs/training.md (0.25 M parameters)."""

    d_model: int = 96
    layers: int = 2
    heads: int = 4
    context: int = 64
    batch_size: int = 16
    lr: float = 2e-3
    eval_windows: int = 128
    seed: int = 0
    warm_start: str = ""  # parameters every peer and rank start from (`warm_start`); "" = the seed's

    def args(self) -> list[str]:
        return ["--d-model", str(self.d_model), "--layers", str(self.layers), "--heads", str(self.heads),
                "--context", str(self.context), "--batch-size", str(self.batch_size), "--lr", str(self.lr),
                "--eval-windows", str(self.eval_windows), "--seed", str(self.seed),
                *(["--warm-start", self.warm_start] if self.warm_start else [])]


def peer_argv(settings: LMSettings, *, coordinator: str, key: str, data_shard: int, num_data_shards: int,
              events: str, algorithm: str, speed: float, advertise: str = "", listen: str = "127.0.0.1:0",
              shared_memory: bool = True, extra: list[str] = ()) -> list[str]:
    """`python -m shoal.bench.lm_worker peer ...`; `extra`: the swarm's log, metrics and security flags.
    shared_memory=False: no shared-memory lane to peers on this host (a peer in a network namespace
    stands for a host of its own: its tensors must cross its shaped link)."""
    return [sys.executable, "-m", "shoal.bench.lm_worker", "peer", "--coordinator", coordinator, "--listen", listen,
            *(["--advertise", advertise] if advertise else []), "--key", key, "--data-shard", str(data_shard),
            "--num-data-shards", str(num_data_shards), "--events", events, "--algorithm", algorithm,
            "--speed", str(speed), *([] if shared_memory else ["--no-shared-memory"]),
            "--result", str(pathlib.Path(events).with_suffix(".result.json")),
            *settings.args(), *extra]


def bits(loss: float) -> float:
    return loss / math.log(2) if math.isfinite(loss) else math.nan


def evaluations(events_paths: list[pathlib.Path]) -> dict[int, float]:
    """{round index: val_loss} from the evaluations files next to the peers' events files
    (`peer-0.val.jsonl`: the evaluating peer's Evaluator, shoal.bench.lm_worker); a missing file or a
    torn last line (a process killed while writing) is skipped."""
    out: dict[int, float] = {}
    for path in events_paths:
        try:
            lines = path.with_suffix(".val.jsonl").read_text().splitlines()
        except OSError:
            continue
        for line in lines:
            try:
                rec = json.loads(line)
                out[int(rec["round"])] = float(rec["val_loss"])
            except (ValueError, KeyError, TypeError):
                continue
    return out


def summary(events_by_peer: list[list[dict]], t0: float, evaluated: dict[int, float] | None = None) -> dict:
    """val_loss / val_bits_per_byte of the final committed state, and val_curve (module docstring).

    `events_by_peer`: each peer slot's events (shoal.testbeds.swarm.Swarm.events); `t0`: the swarm's start,
    unix seconds; `evaluated`: {round index: val_loss} (`evaluations`), which the LM peers write
    instead of putting the loss in their commit events (a value in an event counts as well). The
    evaluating peer (data shard 0) evaluates; the others record NaN. A round that peer missed (it
    was syncing) has no point on the curve; `val_loss` is NaN when it did not end on the last
    committed state."""
    finals = [next((e for e in reversed(evs) if e["event"] == "finished"), None) for evs in events_by_peer]
    top = max((f["rounds"] for f in finals if f is not None), default=0)
    # Only a peer that ended on the last committed state speaks for it (one left behind holds an older one).
    losses = [f["test_accuracy"] for f in finals
              if f is not None and f["rounds"] == top and _finite(f.get("test_accuracy"))]
    sent: dict[int, dict[int, int]] = {}  # round -> slot -> bytes that slot's process had sent at its commit
    when: dict[int, float] = {}
    val: dict[int, float] = {r: v for r, v in (evaluated or {}).items() if _finite(v)}
    for slot, evs in enumerate(events_by_peer):
        for e in evs:
            if e["event"] != "commit":
                continue
            r = int(e["round"])
            sent.setdefault(r, {})[slot] = int(e.get("bytes_sent", 0))
            when[r] = min(when.get(r, math.inf), e["t"] - t0)
            if _finite(e.get("test_accuracy")):
                val[r] = float(e["test_accuracy"])
    curve = [{"round": r + 1, "seconds": round(when[r], 3), "bytes_sent_total": sum(sent[r].values()),
              "val_loss": round(val[r], 5)} for r in sorted(val) if r in when]
    loss = min(losses) if losses else (curve[-1]["val_loss"] if curve and curve[-1]["round"] == top else math.nan)
    return {"workload": "lm", "val_loss": round(loss, 5), "val_bits_per_byte": round(bits(loss), 5),
            "val_curve": curve}


def utilization(events_paths: list[pathlib.Path]) -> dict:
    """The compute-utilization keys from the peers' result files (next to their events files; a
    peer that left none counts as None, and so does, for the window figure, one whose process had
    no phase committed), docs/training.md:

    - `compute_utilization` (the minimum over peers) and `compute_utilization_per_peer`: the
      training window, seconds in the inner steps of the phases that reached a commit / seconds
      from the peer's first inner step to the hand-over of its last such phase
      (shoal.peer.compute_accounting.ComputeLedger);
    - `compute_utilization_lifetime` (minimum) and `compute_utilization_lifetime_per_peer`: all
      inner-step seconds / the peer's wall time from joining to having left;
    - `inner_steps_per_peer`, the inner steps each ran (with local_work = "time" a slow peer runs
      fewer); `overlapped_steps_per_peer`, those run while a round was in flight (`--overlap`; 0
      without); `seconds_by_part_per_peer`, where each peer's wall time went (shoal.bench.lm_worker)."""
    per, life, steps, overlapped, parts = [], [], [], [], []
    for path in events_paths:
        try:
            result = json.loads(path.with_suffix(".result.json").read_text())
            per.append(result["compute_utilization"])
            life.append(result.get("compute_utilization_lifetime"))
            steps.append(int(result["steps"]))
            overlapped.append(int(result.get("overlapped_steps", 0)))
            parts.append(result.get("seconds_by_part"))
        except (OSError, ValueError, KeyError):
            for column in (per, life, steps, overlapped, parts):
                column.append(None)
    return {"compute_utilization": _least(per), "compute_utilization_per_peer": per,
            "compute_utilization_lifetime": _least(life), "compute_utilization_lifetime_per_peer": life,
            "inner_steps_per_peer": steps, "overlapped_steps_per_peer": overlapped,
            "seconds_by_part_per_peer": parts}


def _least(values: list) -> float | None:
    known = [v for v in values if v is not None]
    return min(known) if known else None


def round_timing(events_by_peer: list[list[dict]]) -> dict:
    """How long rounds took and how much of that was the all-reduce, from the peers' events
    (unix-second `t`): for every committed round after the first, `period` = its first commit
    event - the previous round's first commit event, and `allreduce` = its first commit event -
    the first "plan" event of its committed attempt (the all-reduce, the vote and the commit; the
    local phase and the wait for Ready come before the plan). Returns `round_seconds_median`,
    `allreduce_seconds_median` and `allreduce_share_median` (median over rounds of
    allreduce / period); None each when fewer than two rounds committed."""
    commit_t: dict[int, float] = {}
    attempt: dict[int, int] = {}
    plans: dict[tuple[int, int], float] = {}
    for evs in events_by_peer:
        for e in evs:
            key = (int(e.get("round", -1)), int(e.get("attempt", 0)))
            if e["event"] == "commit":
                commit_t[key[0]] = min(commit_t.get(key[0], math.inf), e["t"])
                attempt[key[0]] = key[1]
            elif e["event"] == "plan":
                plans[key] = min(plans.get(key, math.inf), e["t"])
    periods, reduces, shares = [], [], []
    for r in sorted(commit_t):
        plan = plans.get((r, attempt[r]))
        if r - 1 not in commit_t or plan is None:
            continue
        period, reduce = commit_t[r] - commit_t[r - 1], commit_t[r] - plan
        if period > 0:
            periods.append(period)
            reduces.append(reduce)
            shares.append(reduce / period)
    if not periods:
        return {"round_seconds_median": None, "allreduce_seconds_median": None, "allreduce_share_median": None}
    return {"round_seconds_median": round(statistics.median(periods), 4),
            "allreduce_seconds_median": round(statistics.median(reduces), 4),
            "allreduce_share_median": round(statistics.median(shares), 4)}


def peak_rate(spans: list[tuple[float, float, float]], window: float = 1.0) -> float:
    """The most bytes any `window`-second interval holds, divided by `window` (bytes/s), for
    transfers `(start, end, bytes)` each spread evenly over `[start, end]` (one of no duration
    counts whole at its instant). Exact for that model: the windowed sum is piecewise linear in
    the window's start, so its maximum is at a start equal to some span's start or end, or to
    one of those minus `window`. 0.0 for no spans."""
    if not spans:
        return 0.0
    cands = {t - d for s, e, _ in spans for t in (s, e) for d in (0.0, window)}

    def held(a: float) -> float:
        b, total = a + window, 0.0
        for s, e, n in spans:
            if e <= s:
                total += n if a <= s <= b else 0.0
            else:
                total += n * max(0.0, min(b, e) - max(a, s)) / (e - s)
        return total

    return max(held(a) for a in cands) / window


def traffic(events_by_peer: list[list[dict]], window: float = 1.0) -> dict:
    """Bandwidth figures from the peers' "collective" events (each attempt that produced a
    result: bytes sent and received between `started_at` and `ended_at`) and "commit" events:

    - `peak_bytes_per_s_per_peer` / `peak_received_bytes_per_s_per_peer`: per peer, the most bytes
      it sent (received) in any `window`-second interval / `window`, each attempt's bytes spread
      evenly over its duration (`peak_rate`); `peak_bytes_per_s` is the largest of the first.
    - `bytes_per_round_median`: over committed rounds, the bytes all participants sent in the
      committed attempt (with fragments: one fragment round's).
    - `rounds_per_fragment`: committed rounds per fragment (`{"0": ..., "1": ...}`; one key
      without fragments).
    """
    peaks, peaks_in = [], []
    sent: dict[tuple[int, int], int] = {}
    frag: dict[int, int] = {}
    committed: dict[int, int] = {}
    for evs in events_by_peer:
        out, inn = [], []
        for e in evs:
            if e["event"] == "collective" and e.get("started_at"):
                s, t = float(e["started_at"]), float(e["ended_at"])
                out.append((s, t, float(e["bytes_sent"])))
                inn.append((s, t, float(e["bytes_received"])))
                key = (int(e["round"]), int(e["attempt"]))
                sent[key] = sent.get(key, 0) + int(e["bytes_sent"])
                frag[key[0]] = int(e.get("fragment", 0))
            elif e["event"] == "commit":
                committed[int(e["round"])] = int(e["attempt"])
        peaks.append(round(peak_rate(out, window)))
        peaks_in.append(round(peak_rate(inn, window)))
    per_round = [sent[(r, a)] for r, a in committed.items() if (r, a) in sent]
    counts: dict[str, int] = {}
    for r in committed:
        k = str(frag.get(r, 0))
        counts[k] = counts.get(k, 0) + 1
    return {"peak_bytes_per_s_per_peer": peaks, "peak_received_bytes_per_s_per_peer": peaks_in,
            "peak_bytes_per_s": max(peaks, default=0),
            "bytes_per_round_median": int(statistics.median(per_round)) if per_round else None,
            "rounds_per_fragment": dict(sorted(counts.items(), key=lambda kv: int(kv[0])))}


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


def warm_start(settings: LMSettings, *, world: int, steps: int, workdir: pathlib.Path, timeout: float) -> tuple[LMSettings, dict]:
    """`--warm-start-steps`: train the seed's model for `steps` synchronous steps (one process,
    `world` x batch windows a step: what `steps` steps of the ddp baseline compute, the same for
    Shoal and the baseline, as the DiLoCo paper starts both from one pretrained model) and return
    the settings that start every peer and rank from it, and {warm_start_steps,
    warm_start_val_loss}. Raises RuntimeError when the process fails or passes `timeout`."""
    out = workdir / "warm-start.pt"
    argv = [sys.executable, "-m", "shoal.bench.lm_worker", "warm", "--world", str(world), "--steps", str(steps),
            "--out", str(out), *settings.args()]
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"warm start did not finish within {timeout:.0f}s") from None
    if p.returncode != 0:
        raise RuntimeError(f"warm start failed:\n{p.stderr[-2000:]}")
    got = json.loads(p.stdout.strip().splitlines()[-1])
    return dataclasses.replace(settings, warm_start=str(out)), {
        "warm_start_steps": steps, "warm_start_val_loss": round(got["val_loss"], 5)}


def store_uri(path: pathlib.Path) -> str:
    """The torch.distributed init method of a file store at `path`: an absolute file URI.
    "file://" + a relative path (`--workdir wd`) reads as host "wd" and path "/baseline-ddp.store":
    one file that every run shared, so a later run's ranks read an earlier run's addresses ("Gloo
    connectFullMesh failed ... Connection refused") or waited on them."""
    return path.resolve().as_uri()


def run_ddp_baseline(settings: LMSettings, *, world: int, steps: int, eval_every: int, workdir: pathlib.Path,
                     timeout: float) -> dict:
    """Run the synchronous baseline (module docstring) to completion; returns baseline_val_loss,
    baseline_val_bits_per_byte, baseline_bytes_sent_total, baseline_wall_seconds, baseline_steps,
    baseline_curve. Raises RuntimeError when a rank fails or `timeout` seconds pass."""
    out = workdir / "baseline-ddp.jsonl"
    out.unlink(missing_ok=True)
    # A file store, not a TCP port picked in advance: a port freed and re-bound can be taken in
    # between by another process (seen in CI, under parallel load).
    store = workdir / "baseline-ddp.store"
    store.unlink(missing_ok=True)
    init = store_uri(store)
    group = ProcessGroup(workdir)
    procs: list[subprocess.Popen] = []
    t0 = time.monotonic()
    t0_wall = time.time()
    try:
        for rank in range(world):
            (workdir / f"baseline-ddp-{rank}.log").unlink(missing_ok=True)
            procs.append(group.start(f"baseline-ddp-{rank}", [
                sys.executable, "-m", "shoal.bench.lm_worker", "ddp", "--world", str(world), "--init", init,
                "--steps", str(steps), "--eval-every", str(eval_every), "--data-shard", str(rank),
                "--num-data-shards", str(world), *settings.args(), *(["--out", str(out)] if rank == 0 else [])]))
        while any(p.poll() is None for p in procs):
            bad = [i for i, p in enumerate(procs) if p.poll() not in (None, 0)]
            if bad:
                raise RuntimeError(f"baseline rank {bad[0]} failed:\n{_tail(workdir / f'baseline-ddp-{bad[0]}.log')}")
            if time.monotonic() - t0 > timeout:
                raise RuntimeError(f"baseline did not finish within {timeout:.0f}s")
            time.sleep(0.2)
        bad = [i for i, p in enumerate(procs) if p.returncode != 0]
        if bad:
            raise RuntimeError(f"baseline rank {bad[0]} failed:\n{_tail(workdir / f'baseline-ddp-{bad[0]}.log')}")
    finally:
        group.close()
    wall = time.monotonic() - t0
    rows = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    last = rows[-1]
    curve = [{"step": r["step"], "seconds": round(r["t"] - t0_wall, 3), "bytes_sent_total": r["bytes_sent_total"],
              "val_loss": round(r["val_loss"], 5)} for r in rows]
    return {"baseline": "ddp", "baseline_val_loss": round(last["val_loss"], 5),
            "baseline_val_bits_per_byte": round(bits(last["val_loss"]), 5),
            "baseline_bytes_sent_total": int(last["bytes_sent_total"]), "baseline_wall_seconds": round(wall, 3),
            "baseline_steps": int(last["step"]), "baseline_curve": curve}


def _tail(path: pathlib.Path, n: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def time_to_target(curve: list[dict], target: float) -> float | None:
    """Seconds (the curve's `seconds`) at which val_loss first reached <= target; None if never."""
    return next((p["seconds"] for p in curve if p["val_loss"] <= target), None)
