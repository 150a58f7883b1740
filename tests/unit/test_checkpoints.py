"""Durable local checkpoints (peer.checkpoints): atomic write, keep-K, digest check on load, a
damaged newest checkpoint skipped for the previous one, another run or model refused, a full disk
failing the checkpoint and not the caller, export; the background writer (one write in flight, a
newer due checkpoint replacing a waiting one, the snapshot a copy, a bounded wait at exit, an
abandoned temporary directory never read). No processes."""

from __future__ import annotations

import dataclasses
import fcntl
import json
import logging
import os
import shutil
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from safetensors.numpy import load_file

from shoal.peer import checkpoints as ck
from shoal.peer.training import RunConfig
from shoal.peer.workloads.digits import DigitsWorkload

pytestmark = pytest.mark.timeout(60)

CFG = RunConfig(inner_steps=2, hidden=8)


def trained(rounds: int, cfg: RunConfig = CFG) -> DigitsWorkload:
    """A digits workload after `rounds` outer steps of its own pseudo-gradients."""
    w = DigitsWorkload(cfg, 0)
    for _ in range(rounds):
        u = w.local_update()
        w.apply(w.tentative(u.pseudo_grad))
    return w


def write(tmp_path, w: DigitsWorkload, keep: int = 3) -> ck.Checkpoint:
    return ck.write_checkpoint(tmp_path, w.state, w.cfg, ck.param_layout(w), local=w.local_state(), keep=keep)


def test_round_trip_names_and_digest(tmp_path):
    w = trained(3)
    c = write(tmp_path, w)
    assert c.path.name == "round-00000003" and c.round == 3 and c.digest == w.state.digest()
    tensors = load_file(str(c.state_file))  # plain safetensors, tensors by their workload names
    assert tensors["fc0.weight"].shape == (64, 8) and tensors["fc1.bias"].shape == (10,)
    assert any(k.startswith("shoal.outer.") for k in tensors) and "shoal.local.inner.m" in tensors
    manifest = json.loads((c.path / "manifest.json").read_text())
    assert manifest["format_version"] == ck.FORMAT_VERSION and manifest["run_id"] == ck.run_identity(CFG)
    assert manifest["files"] == [{"name": "state.safetensors", "bytes": c.state_file.stat().st_size}]
    state, got, local = ck.load_newest(tmp_path, CFG, ck.param_layout(w))
    assert got.round == 3 and state.digest() == w.state.digest() and state.rounds == 3
    np.testing.assert_array_equal(state.params, w.state.params)
    fresh = DigitsWorkload(CFG, 0)
    fresh.load_local_state(local)
    np.testing.assert_array_equal(fresh.inner.m, w.inner.m)
    assert fresh.inner.t == w.inner.t
    assert not list(tmp_path.glob(".tmp-*"))


def test_keeps_the_last_k(tmp_path):
    w = DigitsWorkload(CFG, 0)
    for r in range(1, 6):
        u = w.local_update()
        w.apply(w.tentative(u.pseudo_grad))
        write(tmp_path, w, keep=2)
    assert [c.round for c in ck.list_checkpoints(tmp_path)] == [5, 4]


def test_truncated_newest_falls_back_to_the_previous(tmp_path, caplog):
    w = trained(1)
    write(tmp_path, w)
    u = w.local_update()
    w.apply(w.tentative(u.pseudo_grad))
    newest = write(tmp_path, w)
    data = newest.state_file.read_bytes()
    newest.state_file.write_bytes(data[: len(data) // 2])
    with caplog.at_level(logging.WARNING, "shoal.peer.checkpoints"):
        state, got, _ = ck.load_newest(tmp_path, CFG, ck.param_layout(w))
    assert got.round == 1 and state.rounds == 1
    assert str(newest.state_file) in caplog.text


def test_corrupted_bytes_fail_the_digest(tmp_path, caplog):
    w = trained(2)
    c = write(tmp_path, w)
    data = bytearray(c.state_file.read_bytes())
    data[-5] ^= 0xFF  # one parameter byte, same size
    c.state_file.write_bytes(bytes(data))
    with pytest.raises(ck.CheckpointError, match="digest"):
        ck.verify(c)
    with caplog.at_level(logging.WARNING, "shoal.peer.checkpoints"):
        assert ck.load_newest(tmp_path, CFG, ck.param_layout(w)) is None
    assert "state.safetensors" in caplog.text


def test_another_run_or_model_is_refused(tmp_path):
    w = trained(1)
    write(tmp_path, w)
    other = dataclasses.replace(CFG, seed=7)
    with pytest.raises(ck.CheckpointMismatch, match=ck.run_identity(other)) as e:
        ck.load_newest(tmp_path, other, ck.param_layout(w))
    assert ck.run_identity(CFG) in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ck.CheckpointMismatch, match="model"):
        ck.load_newest(tmp_path, CFG, (("params", (w.num_params,)),))


def test_only_digests_the_coordinator_recorded(tmp_path):
    w = trained(2)
    write(tmp_path, w)
    layout = ck.param_layout(w)
    assert ck.load_newest(tmp_path, CFG, layout, digests={2: b"\0" * 32}) is None
    assert ck.load_newest(tmp_path, CFG, layout, digests={2: w.state.digest()})[1].round == 2


def test_unwritable_directory_fails_the_checkpoint_not_the_caller(tmp_path, caplog):
    w = trained(2)
    blocker = tmp_path / "blocker"
    blocker.write_text("a file where the checkpoint directory should be")
    cp = ck.Checkpointer(blocker / "ck", every=2)
    with caplog.at_level(logging.WARNING, "shoal.peer.checkpoints"):
        assert cp.committed(w) is None
    assert cp.failures == 1 and cp.due and "retried" in caplog.text
    blocker.unlink()
    blocker.mkdir()
    u = w.local_update()
    w.apply(w.tentative(u.pseudo_grad))  # round 3: not a multiple of 2, but the failed write is due
    assert cp.committed(w).round == 3 and cp.last_round == 3 and not cp.due


def test_full_disk_is_a_warning(tmp_path, monkeypatch, caplog):
    def full(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ck, "save_file", full)
    cp = ck.Checkpointer(tmp_path, every=1)
    with caplog.at_level(logging.WARNING, "shoal.peer.checkpoints"):
        assert cp.committed(trained(1)) is None
    assert "No space left" in caplog.text and [p.name for p in tmp_path.iterdir()] == [".lock"]  # nothing partial


def test_checkpointer_writes_every_n(tmp_path):
    w = DigitsWorkload(CFG, 0)
    cp = ck.Checkpointer(tmp_path, every=2, keep=5)
    written = []
    for _ in range(5):
        u = w.local_update()
        w.apply(w.tentative(u.pseudo_grad))
        c = cp.committed(w)
        written.append(c.round if c else None)
    assert written == [None, 2, None, 4, None] and cp.last_bytes > 0


def test_export_safetensors_and_torch(tmp_path):
    w = trained(2)
    c = write(tmp_path / "ck", w)
    out = ck.export(c, tmp_path / "model.safetensors")
    t = load_file(str(out))
    assert sorted(t) == ["fc0.bias", "fc0.weight", "fc1.bias", "fc1.weight"]
    np.testing.assert_array_equal(np.concatenate([t[n].reshape(-1) for n, _ in ck.param_layout(w)]), w.state.params)
    torch = pytest.importorskip("torch")
    pt = ck.export(c, tmp_path / "model.pt", "torch")
    sd = torch.load(pt)
    assert torch.equal(sd["fc0.weight"], torch.from_numpy(t["fc0.weight"]))


def test_cli_list_verify_export(tmp_path, capsys):
    from shoal.cli import main

    w = trained(1)
    write(tmp_path / "ck", w)
    u = w.local_update()
    w.apply(w.tentative(u.pseudo_grad))
    newest = write(tmp_path / "ck", w)
    d = str(tmp_path / "ck")
    assert main(["checkpoint", "list", d]) == 0
    assert capsys.readouterr().out.splitlines()[1].split()[0] == "2"
    assert main(["checkpoint", "verify", d]) == 0
    data = newest.state_file.read_bytes()
    newest.state_file.write_bytes(data[:-100])  # truncated newest
    assert main(["checkpoint", "verify", d]) == 1
    assert str(newest.state_file) in capsys.readouterr().out
    out = tmp_path / "model.safetensors"
    assert main(["checkpoint", "export", d, "--out", str(out)]) == 0  # falls back to round 1
    assert "round 1" in capsys.readouterr().out and sorted(load_file(str(out)))[0] == "fc0.bias"
    assert main(["checkpoint", "list", str(tmp_path / "nothing")]) == 2


def test_resume_takes_the_newest_verified_checkpoint(tmp_path):
    w = trained(3)
    write(tmp_path, w)
    fresh = DigitsWorkload(CFG, 0)
    c = ck.resume(fresh, tmp_path)
    assert c.round == 3 and fresh.state.digest() == w.state.digest() and fresh.inner.t == w.inner.t
    assert ck.resume(fresh, tmp_path) is None  # not newer than what it holds
    assert ck.resume(DigitsWorkload(CFG, 0), tmp_path / "empty") is None


def test_resume_from_seeds_a_new_coordinator_state_at_the_newest_verified_checkpoint(tmp_path):
    from shoal.cli import UsageError, _resume_point
    from shoal.coordinator.daemon import CoordinatorConfig, open_state
    from shoal.coordinator.store import MemoryStore

    w = trained(2)
    write(tmp_path, w)
    w.apply(w.tentative(w.local_update().pseudo_grad))
    newest = write(tmp_path, w)
    with open(newest.state_file, "r+b") as f:  # the newest is damaged: the previous one is the point
        f.truncate(100)
    point = _resume_point(f"file://{tmp_path}")
    assert (point.rounds, point.state_digest) == (2, trained(2).state.digest())
    engine, store, run_config = open_state(CoordinatorConfig(resume=point), 0.0, MemoryStore())
    assert engine.committed_rounds == 2 and engine.last_state_digest == point.state_digest
    # The peers' run id is the checkpoint's: the coordinator hands out the checkpoint's configuration.
    assert ck.run_identity(RunConfig.from_json(run_config)) == ck.run_identity(CFG)
    # A state that already holds a run keeps it.
    again, _, _ = open_state(CoordinatorConfig(resume=dataclasses.replace(point, rounds=7)), 0.0, store)
    assert again.committed_rounds == 2
    with pytest.raises(UsageError, match="no checkpoint there passes"):
        _resume_point(str(tmp_path / "round-00000003"))


def test_an_elected_checkpointer_uploads_and_a_peer_without_checkpoints_takes_the_stores(tmp_path):

    url = f"file://{tmp_path / 'store'}"
    up = ck.Checkpointer(tmp_path / "a", every=1, keep=2, url=url)
    w = trained(0)
    for r in range(1, 4):
        w.apply(w.tentative(w.local_update().pseudo_grad))
        ckpt = up.committed(w)
        if r != 2:  # round 2: another peer was elected
            assert up.upload(ckpt)
    assert sorted(p.name for p in (tmp_path / "store").iterdir()) == ["round-00000001", "round-00000003"]
    assert up.uploaded_round == 3 and up.failures == 0
    fresh = ck.Checkpointer(tmp_path / "b", every=1, url=url)  # a new machine: nothing local
    assert fresh.fetch_from_store()[0] == 3
    w2 = DigitsWorkload(CFG, 0)
    got = ck.resume(w2, fresh.directory)
    assert got.round == 3 and w2.state.digest() == w.state.digest()
    assert fresh.fetch_from_store() == []  # nothing newer than what it holds


def test_an_unreachable_store_fails_the_upload_not_the_checkpoint(tmp_path, caplog):
    blocked = tmp_path / "not-a-dir"
    blocked.write_text("a file where the store's directory should be")
    c = ck.Checkpointer(tmp_path / "a", every=1, url=f"file://{blocked}/prefix")
    w = trained(1)
    with caplog.at_level(logging.WARNING):
        assert not c.upload(c.committed(w))
    assert c.failures == 1 and c.uploaded_round == -1 and f"checkpoint store file://{blocked}/prefix" in caplog.text
    assert c.fetch_from_store() == []


def test_checkpoint_urls_are_file_or_s3():
    from shoal.peer.checkpoint_store import check_url

    assert check_url("s3://bucket/run/") == "s3://bucket/run" and check_url("file:///tmp/x") == "file:///tmp/x"
    for bad in ("http://x/y", "s3://", "/tmp/x", "s3:///nobucket"):
        with pytest.raises(ValueError, match="checkpoint_url"):
            check_url(bad)


# ------------------------------------------------------------ the background writer


class HeldLock:
    """The checkpoint directory's lock held, as another process writing there would hold it."""

    def __init__(self, root):
        root.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(root / ".lock", os.O_RDWR | os.O_CREAT)
        fcntl.flock(self.fd, fcntl.LOCK_EX)

    def release(self):
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)


def wait_until(cond, timeout=10.0):
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.01)


def step(w: DigitsWorkload) -> None:
    w.apply(w.tentative(w.local_update().pseudo_grad))


def test_a_checkpoint_due_while_one_is_written_waits_and_a_newer_one_replaces_it(tmp_path):
    """One write in flight; the next due snapshot waits in one slot; a newer one replaces it there
    (never written, its upload duty with it); another process's write (the directory's lock)
    is waited for; the callbacks come in the order of the writes."""
    root, url = tmp_path / "ck", f"file://{tmp_path / 'store'}"
    written, uploaded = [], []
    cp = ck.Checkpointer(root, every=2, keep=5, url=url, on_written=lambda c: written.append(c.round),
                         on_uploaded=lambda c: uploaded.append(c.round))
    w = trained(2)
    other = HeldLock(root)
    try:
        assert cp.submit(w, upload=True).rounds == 2  # returns at once, the lock is held
        wait_until(lambda: cp.writing == 2)
        for upload in (True, False):  # round 4 (elected) waits, round 6 replaces it
            step(w)
            assert cp.submit(w) is None  # round 3: not due
            step(w)
            assert cp.submit(w, upload=upload).rounds == w.state.rounds
        assert cp.superseded == 1 and written == [] and ck.list_checkpoints(root) == []
    finally:
        other.release()
    assert cp.flush(10)
    assert written == [2, 6] and uploaded == [2] and cp.last_round == 6
    assert [c.round for c in ck.list_checkpoints(root)] == [6, 2]
    assert [c.round for c in ck.list_checkpoints(tmp_path / "store")] == [2]
    assert ck.verify(ck.list_checkpoints(root)[0]).digest() == w.state.digest()
    assert cp.close(1) and cp.submit(trained(8)) is None  # closed: nothing more is taken


def test_the_background_write_holds_the_state_of_its_commit(tmp_path):
    """The snapshot is a copy: training after the commit (even in place) does not reach the file."""
    root = tmp_path / "ck"
    cp = ck.Checkpointer(root, every=1)
    w = trained(1)
    want_digest, want_m = w.state.digest(), w.inner.m.copy()
    other = HeldLock(root)
    try:
        cp.submit(w)
        wait_until(lambda: cp.writing == 1)
        w.state.params[:] = 0.0  # what an in-place update of the parameters would do
        w.inner.m[:] = 7.0
    finally:
        other.release()
    assert cp.flush(10) and cp.close(1)
    got = ck.list_checkpoints(root)[0]
    assert ck.verify(got).digest() == want_digest
    np.testing.assert_array_equal(load_file(str(got.state_file))["shoal.local.inner.m"], want_m)


def test_a_failed_background_write_is_retried_at_the_next_commit(tmp_path, caplog):
    blocker = tmp_path / "blocker"
    blocker.write_text("a file where the checkpoint directory should be")
    failed, written = [], []
    cp = ck.Checkpointer(blocker / "ck", every=2, on_failed=lambda: failed.append(1),
                         on_written=lambda c: written.append(c.round))
    w = trained(2)
    with caplog.at_level(logging.WARNING, "shoal.peer.checkpoints"):
        cp.submit(w)
        assert cp.flush(10)
    assert cp.failures == 1 and failed == [1] and cp.due and "retried at the next commit" in caplog.text
    blocker.unlink()
    blocker.mkdir()
    step(w)  # round 3: not a multiple of 2, but the failed write is due
    cp.submit(w)
    assert cp.flush(10) and cp.close(1) and written == [3] and not cp.due


def test_a_write_abandoned_at_exit_is_never_taken_for_a_checkpoint(tmp_path, caplog):
    """close() bounds the wait for a write in flight; what a process killed mid-write leaves (a
    complete `.tmp-*` directory, not renamed) is never listed or loaded, and the next write
    removes it."""
    root = tmp_path / "ck"
    w = trained(2)
    write(root, w)
    leftover = root / ".tmp-4-99999"
    shutil.copytree(root / "round-00000002", leftover)  # every file there, manifest included
    manifest = json.loads((leftover / ck.MANIFEST_FILE).read_text())
    (leftover / ck.MANIFEST_FILE).write_text(json.dumps({**manifest, "round": 4}))
    cp = ck.Checkpointer(root, every=2)
    step(w)
    step(w)
    other = HeldLock(root)
    try:
        cp.submit(w)
        wait_until(lambda: cp.writing == 4)
        with caplog.at_level(logging.WARNING, "shoal.peer.checkpoints"):
            assert not cp.close(0.2)
        assert "rounds [4] and uploads of rounds [] abandoned" in caplog.text
        assert [c.round for c in ck.list_checkpoints(root)] == [2]
        assert ck.load_newest(root, w.cfg, ck.param_layout(w))[1].round == 2
    finally:
        other.release()
    wait_until(lambda: cp.writing == -1)  # the abandoned thread ends its write (a process exit would cut it)
    assert not leftover.exists() and [c.round for c in ck.list_checkpoints(root)] == [4, 2]


def test_uploads_in_a_helper_process_and_a_dead_helper_fails_only_that_upload(tmp_path, caplog, monkeypatch):
    """`helper=True` (a peer's way): the upload runs in a helper process; one that died is started
    afresh; one that dies during an upload fails that upload with a warning, and the next upload
    starts a fresh helper."""
    url = f"file://{tmp_path / 'store'}"
    uploaded = []
    cp = ck.Checkpointer(tmp_path / "ck", every=1, url=url, helper=True, on_uploaded=lambda c: uploaded.append(c.round))
    w = trained(1)
    try:
        cp.submit(w, upload=True)
        assert cp.flush(60) and uploaded == [1]
        helper = cp._uploader._proc
        assert helper.pid != os.getpid() and helper.poll() is None
        helper.kill()
        helper.wait(10)
        step(w)
        cp.submit(w, upload=True)  # a fresh helper
        assert cp.flush(60) and uploaded == [1, 2] and cp._uploader._proc.pid != helper.pid
        real_start = ck.checkpoint_store.Uploader._start
        cp._uploader.close()
        monkeypatch.setattr(ck.checkpoint_store.Uploader, "_start", lambda self: subprocess.Popen(
            [sys.executable, "-c", "import sys; sys.stdin.readline()"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            text=True))  # reads the request and exits without answering
        step(w)
        with caplog.at_level(logging.WARNING, "shoal.peer.checkpoints"):
            cp.submit(w, upload=True)
            assert cp.flush(60)
        assert uploaded == [1, 2] and cp.failures == 1 and "upload helper exited" in caplog.text
        monkeypatch.setattr(ck.checkpoint_store.Uploader, "_start", real_start)
        step(w)
        cp.submit(w, upload=True)
        assert cp.flush(60) and uploaded == [1, 2, 4]
        assert [c.round for c in ck.list_checkpoints(tmp_path / "store")] == [4, 2, 1]
    finally:
        assert cp.close(10)
    assert cp._uploader._proc is None  # closed: the helper ended


def test_a_slow_upload_holds_back_neither_the_local_writes_nor_loses_its_files(tmp_path, monkeypatch, caplog):
    """While an upload runs, the next checkpoints are written locally at once; one elected meanwhile
    is not uploaded (a warning); the checkpoint being uploaded is kept from pruning until its
    upload ended."""
    release = threading.Event()
    real_upload = ck.checkpoint_store.upload

    def slow_upload(path, url, keep=3):
        assert release.wait(20)
        return real_upload(path, url, keep)

    monkeypatch.setattr(ck.checkpoint_store, "upload", slow_upload)
    root, written, uploaded = tmp_path / "ck", [], []
    cp = ck.Checkpointer(root, every=2, keep=1, url=f"file://{tmp_path / 'store'}",
                         on_written=lambda c: written.append(c.round), on_uploaded=lambda c: uploaded.append(c.round))
    w = trained(2)
    cp.submit(w, upload=True)
    wait_until(lambda: cp.uploading == 2)
    with caplog.at_level(logging.WARNING, "shoal.peer.checkpoints"):
        for _ in range(2):
            step(w)
            step(w)
            cp.submit(w, upload=True)
            wait_until(lambda: written[-1] == w.state.rounds)
    assert written == [2, 4, 6] and "round 4 not uploaded: the upload of round 2 still runs" in caplog.text
    assert [c.round for c in ck.list_checkpoints(root)] == [6, 2]  # keep 1, and round 2 while it uploads
    release.set()
    assert cp.flush(20) and uploaded == [2]
    step(w)
    step(w)
    cp.submit(w)
    assert cp.flush(20) and cp.close(1) and [c.round for c in ck.list_checkpoints(root)] == [8]
