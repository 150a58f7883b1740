"""The language-model workload (`shoal swarm --workload lm`, docs/training.md): corpus split,
model, summary keys, plot, the refusal without PyTorch, and a short swarm with the ddp baseline.

Tests that need PyTorch skip without it; the pure ones (summary, refusal) always run.
"""

from __future__ import annotations

import importlib.util
import math
import pathlib
import sys

import pytest

from shoal import cli
from shoal.bench import lm_job

HAVE_TORCH = importlib.util.find_spec("torch") is not None
needs_torch = pytest.mark.skipif(not HAVE_TORCH, reason="PyTorch is not installed (pip install 'shoal[torch]')")

TINY = lm_job.LMSettings(d_model=32, layers=1, heads=2, context=32, batch_size=8, eval_windows=32)


def _commit(r, sent, val, t):
    return {"event": "commit", "round": r, "bytes_sent": sent, "test_accuracy": val, "t": t}


def test_summary_takes_the_evaluating_peer_and_sums_bytes_over_peers():
    nan = math.nan
    peer0 = [_commit(0, 100, 3.0, 10.0), _commit(1, 200, 2.5, 12.0),
             {"event": "finished", "rounds": 2, "test_accuracy": 2.5}]
    peer1 = [_commit(0, 110, nan, 10.5), _commit(1, 220, nan, 12.5),
             {"event": "finished", "rounds": 2, "test_accuracy": nan}]
    s = lm_job.summary([peer0, peer1], t0=5.0)
    assert s["val_loss"] == 2.5 and s["val_bits_per_byte"] == pytest.approx(2.5 / math.log(2), abs=1e-4)
    assert [p["bytes_sent_total"] for p in s["val_curve"]] == [210, 420]
    assert [p["seconds"] for p in s["val_curve"]] == [5.0, 7.0]
    assert lm_job.time_to_target(s["val_curve"], 2.7) == 7.0 and lm_job.time_to_target(s["val_curve"], 1.0) is None


def test_summary_ignores_an_evaluation_of_a_stale_final_state():
    peer0 = [_commit(0, 100, 3.0, 10.0), {"event": "finished", "rounds": 1, "test_accuracy": 3.0}]
    peer1 = [_commit(0, 100, math.nan, 10.0), _commit(1, 200, math.nan, 11.0),
             {"event": "finished", "rounds": 2, "test_accuracy": math.nan}]
    assert math.isnan(lm_job.summary([peer0, peer1], t0=0.0)["val_loss"])


def test_workload_lm_without_torch_is_refused_in_one_line(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torch", None)  # import fails
    assert cli.main(["swarm", "--workload", "lm", "--peers", "2"]) == cli.EXIT_USAGE
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert err == ['shoal swarm: --workload lm needs PyTorch: pip install -e ".[torch]"'], err


def test_baseline_and_peer_speed_need_the_lm_workload(capsys):
    assert cli.main(["swarm", "--baseline", "ddp"]) == cli.EXIT_USAGE
    assert cli.main(["swarm", "--workload", "lm", "--peers", "2", "--peer-speed", "1,1,0.5"]) == cli.EXIT_USAGE
    assert cli.main(["swarm", "--local-work", "time"]) == cli.EXIT_USAGE
    assert cli.main(["swarm", "--target-val-loss", "2.0"]) == cli.EXIT_USAGE
    assert cli.main(["swarm", "--overlap"]) == cli.EXIT_USAGE
    assert cli.main(["swarm", "--warm-start-steps", "10"]) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert "--baseline" in err and "--peer-speed" in err and "--local-work time needs --workload lm" in err
    assert "--overlap needs --workload lm" in err
    assert "target_val_loss" in err or "--target-val-loss" in err


@needs_torch
def test_corpus_split_is_by_file_fixed_and_disjoint():
    from shoal.peer.workloads import lm

    files = lm.stdlib_files()
    assert files == sorted(files) and not any("site-packages" in p.parts for p in files)
    c = lm.load_corpus()
    assert c.files_val == len(files) // lm.VAL_EVERY and c.files_train + c.files_val == len(files)
    held = files[lm.VAL_EVERY - 1]
    assert held.read_bytes() in c.val.tobytes() and held.read_bytes() not in c.train.tobytes()
    shards = [c.shard(i, 4) for i in range(4)]
    assert len({len(s) for s in shards}) == 1 and shards[1].tobytes() != shards[0].tobytes()


@needs_torch
def test_same_seed_same_model_and_loss_is_per_byte():
    import torch

    from shoal.peer.workloads import lm
    from shoal.torch import flatten

    shape = lm.LMShape(d_model=32, layers=1, heads=2, context=16)
    a, b = lm.make_model(shape, 7), lm.make_model(shape, 7)
    assert (flatten(a) == flatten(b)).all() and not (flatten(a) == flatten(lm.make_model(shape, 8))).all()
    x, y = lm.sample_batch(lm.load_corpus().val, 4, shape.context, torch.Generator().manual_seed(0))
    assert x.shape == (4, 16) and (x[:, 1:] == y[:, :-1]).all()
    assert a(x).shape == (4, 16, 256)
    # An untrained model is close to uniform over the 256 bytes: ln 256 nats per byte.
    with torch.no_grad():
        assert abs(float(a.loss(x, y)) - math.log(256)) < 0.5


def test_plot_lm_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib is not installed (pip install shoal[plot])")
    from shoal.plots import plot_lm

    curve = [{"seconds": s, "bytes_sent_total": b, "val_loss": v} for s, b, v in [(1, 10, 3.0), (2, 20, 2.0)]]
    path = tmp_path / "lm.png"
    plot_lm({"val_curve": curve, "baseline_curve": [{**p, "bytes_sent_total": p["bytes_sent_total"] * 50}
                                                    for p in curve]}, str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_baseline_store_is_an_absolute_file_uri(tmp_path, monkeypatch):
    """A relative --workdir gave "file://wd/baseline-ddp.store": host "wd", path
    "/baseline-ddp.store", shared by every run (stale gloo addresses, refused connections)."""
    import urllib.parse

    monkeypatch.chdir(tmp_path)
    uri = lm_job.store_uri(pathlib.Path("wd") / "baseline-ddp.store")
    parts = urllib.parse.urlparse(uri)
    assert parts.scheme == "file" and parts.netloc == ""
    assert parts.path == str(tmp_path / "wd" / "baseline-ddp.store")


def test_a_peer_in_a_network_namespace_gets_no_shared_memory_lane():
    """The namespaces stand for hosts: an LM peer there must send its tensors over its (shaped)
    link, not through /dev/shm (the all-reduce had bypassed the 100 Mbit/s links)."""
    kw = dict(coordinator="10.0.0.1:7070", key="k", data_shard=0, num_data_shards=2, events="/tmp/e.jsonl",
              algorithm="diloco", speed=1.0)
    assert "--no-shared-memory" not in lm_job.peer_argv(TINY, **kw)
    argv = lm_job.peer_argv(TINY, shared_memory=False, **kw)
    assert "--no-shared-memory" in argv
    if HAVE_TORCH:
        from shoal.bench import lm_worker

        assert lm_worker.parse(argv[3:]).shared_memory is False
        assert lm_worker.parse(lm_job.peer_argv(TINY, **kw)[3:]).shared_memory is True
