"""Training curves of a swarm run from the peers' event logs (matplotlib, Agg backend).

`plot_rounds(events, path)` draws, per committed round, the mean inner training loss and the
held-out accuracy of the committed state (both as the peers recorded them at commit), and marks
every aborted attempt: a red cross for an abort that was given up, an orange triangle for one
that was retried with the survivors (placed at the round it belongs to). Events are the dicts of
the peers' JSON-lines files (`commit` and `abort` records, see peer.agent); the same attempt seen
by several peers is drawn once.
"""

from __future__ import annotations

import math
from collections.abc import Iterable


def curves(events: Iterable[dict]) -> dict:
    """Per-round series: {"round", "loss", "accuracy", "retried", "aborted"} (sorted rounds)."""
    by_round: dict[int, tuple[float, float]] = {}
    retried: set[tuple[int, int]] = set()
    aborted: set[tuple[int, int]] = set()
    for e in events:
        if e.get("event") == "commit":
            by_round.setdefault(int(e["round"]), (float(e["loss"]), float(e["test_accuracy"])))
        elif e.get("event") == "abort":
            key = (int(e["round"]), int(e.get("attempt", 0)))
            (retried if e.get("will_retry") else aborted).add(key)
    rounds = sorted(by_round)
    return {"round": rounds, "loss": [by_round[r][0] for r in rounds],
            "accuracy": [by_round[r][1] for r in rounds], "retried": sorted(retried), "aborted": sorted(aborted)}


def plot_rounds(events: Iterable[dict], path: str, *, title: str = "shoal swarm") -> dict:
    """Write the figure to `path` (format from the suffix, e.g. .png); returns `curves(events)`.
    Raises ImportError without matplotlib and OSError when `path` cannot be written."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    c = curves(events)
    fig, (ax_loss, ax_acc) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    try:
        ax_loss.plot(c["round"], c["loss"], "o-", color="tab:blue", ms=3, label="train loss (mean of inner steps)")
        ax_loss.set_ylabel("loss")
        if c["loss"] and all(v > 0 and math.isfinite(v) for v in c["loss"]):
            ax_loss.set_yscale("log")
        ax_acc.plot(c["round"], c["accuracy"], "o-", color="tab:green", ms=3, label="held-out accuracy")
        ax_acc.set_ylabel("accuracy")
        ax_acc.set_xlabel("round")
        ax_acc.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
        for ax in (ax_loss, ax_acc):
            for r, _ in c["retried"]:
                ax.axvline(r, color="tab:orange", alpha=0.25, lw=1)
            for r, _ in c["aborted"]:
                ax.axvline(r, color="tab:red", alpha=0.4, lw=1)
        if c["retried"]:
            ax_acc.plot([r for r, _ in c["retried"]], [_at(c, r) for r, _ in c["retried"]], "^", color="tab:orange",
                        label=f"aborted, retried ({len(c['retried'])})")
        if c["aborted"]:
            ax_acc.plot([r for r, _ in c["aborted"]], [_at(c, r) for r, _ in c["aborted"]], "x", color="tab:red",
                        label=f"aborted, given up ({len(c['aborted'])})")
        ax_loss.legend(loc="upper right", fontsize=8)
        ax_acc.legend(loc="lower right", fontsize=8)
        ax_loss.set_title(title)
        ax_acc.grid(alpha=0.3)
        ax_loss.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)
    return c


def _at(c: dict, r: int) -> float:
    """The accuracy drawn at round r (the committed value of r, else the nearest earlier one)."""
    best = 0.0
    for rr, acc in zip(c["round"], c["accuracy"]):
        if rr <= r:
            best = acc
    return best


def plot_lm(summary: dict, path: str, *, title: str = "shoal swarm --workload lm") -> None:
    """Validation loss of the LM workload against bytes sent (all peers together, log scale) and
    against wall time, for Shoal (`summary["val_curve"]`) and, when present, the synchronous
    baseline (`summary["baseline_curve"]`); each point of a curve is a dict with `seconds`,
    `bytes_sent_total`, `val_loss` (shoal.bench.lm_job). Raises ImportError without matplotlib and
    OSError when `path` cannot be written."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    series = [("Shoal (one all-reduce per round)", summary.get("val_curve") or [], "tab:blue"),
              ("synchronous DDP (gloo, one per step)", summary.get("baseline_curve") or [], "tab:red")]
    fig, (ax_bytes, ax_time) = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    try:
        for label, curve, color in series:
            pts = [p for p in curve if p["bytes_sent_total"] > 0]
            if pts:
                ax_bytes.plot([p["bytes_sent_total"] / 1e6 for p in pts], [p["val_loss"] for p in pts], "o-",
                              color=color, ms=3, label=label)
            if curve:
                ax_time.plot([p["seconds"] for p in curve], [p["val_loss"] for p in curve], "o-", color=color, ms=3,
                             label=label)
        ax_bytes.set_xscale("log")
        ax_bytes.set_xlabel("bytes sent, all peers (MB, log scale)")
        ax_bytes.set_ylabel("validation loss (nats per byte)")
        ax_time.set_xlabel("wall time (s)")
        for ax in (ax_bytes, ax_time):
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        fig.suptitle(title)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)
