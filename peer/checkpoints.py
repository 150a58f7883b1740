"""Durable local checkpoints of the committed state: write, keep the last K, list, verify, load.

A checkpoint is one directory `round-NNNNNNNN` (the number of committed rounds it reflects) under
the peer's checkpoint directory, holding two files:
- `state.safetensors`: the parameters by their workload names (`fc0.weight`, `tok.weight`, ... or
  `params` when the workload names none), the outer optimizer's arrays as `shoal.outer.<name>`
  and the peer's own local state (e.g. its inner Adam moments) as `shoal.local.<name>`, so that
  `safetensors.numpy.load_file` or `safetensors.torch.load_file` opens it without Shoal;
- `manifest.json`: the format version, round, digest (hex), run id, run configuration, model
  description, and the name and size of every file.

The digest is the committed-state digest the round's vote and the coordinator use
(`CommittedState.digest()`: BLAKE3-256 of its serialization), recomputed from the tensors on load:
a truncated or altered file does not pass. A checkpoint is written in a temporary directory,
every file fsynced, then renamed into place and the parent directory fsynced: a crash leaves either
the whole checkpoint or none (a leftover `.tmp-*` directory is removed by the next write).

Off the round's path: `Checkpointer.submit` takes a copy of the committed state at its commit (a
`Snapshot`, model-sized) and one writer thread per checkpointer writes, fsyncs and renames it (and
uploads it when the peer is elected). At most one write is in flight; a checkpoint that comes due
while one is written waits in a single slot, and a newer one replaces it there (the replaced one is
never written: the newer state supersedes it). One writer per directory: the thread, and an
exclusive `flock` on `<dir>/.lock` against another process. A process that exits during a write
leaves at most a `.tmp-*` directory, which is never read as a checkpoint (only `round-*`
directories are) and is removed by the next write.

Failure semantics: `write_checkpoint` raises OSError (full disk, unwritable directory) and leaves no
partial checkpoint; `Checkpointer.committed` and `submit` never raise: a failed write is a warning,
counted, and retried at the next commit. `load_newest` skips a damaged newest checkpoint for the previous one
with a warning naming the file, and raises CheckpointMismatch (one line naming both) for a
checkpoint of another run or model. Only `FlatStateWorkload` states (`CommittedState`) are
checkpointed. Pure file I/O; tested without processes (tests/test_checkpoints.py).
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import logging
import os
import pathlib
import shutil
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from safetensors.numpy import load_file, save_file

from shoal.common.errors import InvalidArgument
from shoal.common.tensors import digest
from shoal.peer import checkpoint_store
from shoal.peer.workloads.digits import MLPShape
from shoal.peer.training import CommittedState, RunConfig, make_outer_for

log = logging.getLogger("shoal.peer.checkpoints")

FORMAT_VERSION = 1
STATE_FILE = checkpoint_store.STATE_FILE  # "state.safetensors"
MANIFEST_FILE = checkpoint_store.MANIFEST_FILE  # "manifest.json"
OUTER_PREFIX = "shoal.outer."
LOCAL_PREFIX = "shoal.local."
_PREFIX = checkpoint_store.ROUND_PREFIX  # "round-"

Layout = tuple[tuple[str, tuple[int, ...]], ...]  # (name, shape) per parameter, in flat order


class CheckpointError(Exception):
    """A checkpoint that cannot be used: damaged (digest, size, format) or missing."""


class CheckpointMismatch(CheckpointError):
    """A checkpoint of another run or another model than the one asked for."""


@dataclass(frozen=True)
class Checkpoint:
    """One checkpoint on disk: `path` its directory, `manifest` its parsed manifest."""

    path: pathlib.Path
    manifest: dict

    @property
    def round(self) -> int:
        return int(self.manifest["round"])

    @property
    def digest(self) -> bytes:
        return bytes.fromhex(self.manifest["digest"])

    @property
    def state_file(self) -> pathlib.Path:
        return self.path / STATE_FILE

    @property
    def bytes(self) -> int:
        return sum(int(f["bytes"]) for f in self.manifest.get("files", []))


def run_identity(cfg: RunConfig) -> str:
    """The run id: hex BLAKE3-256 of the run configuration's canonical JSON (the configuration every
    peer receives at join), first 16 bytes."""
    return digest(_config_json(cfg).encode())[:16].hex()


def _config_json(cfg: RunConfig) -> str:
    return json.dumps(dataclasses.asdict(cfg), sort_keys=True)


def param_layout(workload) -> Layout:
    """(name, shape) of each parameter in the flat vector's order: the workload's `layout` when it
    has one (the PyTorch integration: `named_parameters()`), the digits MLP's layers
    (`fc<i>.weight` (in, out), `fc<i>.bias`), else one `params` vector."""
    layout = getattr(workload, "layout", None)
    if layout:
        return tuple((str(n), tuple(int(d) for d in s)) for n, s in layout)
    shape = getattr(workload, "shape", None)
    if isinstance(shape, MLPShape):
        out: list[tuple[str, tuple[int, ...]]] = []
        for i, (a, b) in enumerate(zip(shape.widths[:-1], shape.widths[1:])):
            out += [(f"fc{i}.weight", (a, b)), (f"fc{i}.bias", (b,))]
        return tuple(out)
    return (("params", (int(workload.state.params.size),)),)


def describe_model(layout: Layout, outer: str) -> dict:
    """The model description a checkpoint records and a load compares: parameter count, layout,
    outer optimizer."""
    return {"num_params": sum(int(np.prod(s)) for _, s in layout), "outer": outer,
            "layout": [[n, list(s)] for n, s in layout]}


def _tensors(state: CommittedState, layout: Layout, local: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    off = 0
    for name, shape in layout:
        n = int(np.prod(shape))
        out[name] = np.array(state.params[off:off + n].reshape(shape), order="C")  # a copy, never a view
        off += n
    if off != state.params.size:
        raise ValueError(f"layout covers {off} parameters, the state has {state.params.size}")
    for k, v in state.outer.state().items():
        out[OUTER_PREFIX + k] = np.array(v, order="C")  # ascontiguousarray makes 0-d 1-d
    for k, v in local.items():
        out[LOCAL_PREFIX + k] = np.array(v, order="C")
    return out


def _fsync_dir(path: pathlib.Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_file(path: pathlib.Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


@dataclass(frozen=True)
class Snapshot:
    """A copy of a committed state taken at its commit: what a checkpoint of it writes.

    `tensors` are copies (name -> C-contiguous array, the file's content; later training does not
    change them), `digest` the state's 32-byte digest, `rounds` its committed rounds; `upload`:
    the peer was elected to upload this checkpoint to the shared store."""

    rounds: int
    digest: bytes
    tensors: dict[str, np.ndarray]
    cfg: RunConfig
    layout: Layout
    outer: str
    local: tuple[str, ...] = ()
    upload: bool = False


def snapshot(state: CommittedState, cfg: RunConfig, layout: Layout, *, local: dict[str, np.ndarray] | None = None,
             upload: bool = False) -> Snapshot:
    """A copy of `state` (and the peer's `local` arrays) to write later; ValueError when `layout`
    does not cover the parameters. Costs a copy of the state (the digest is the state's cached one)."""
    return Snapshot(state.rounds, state.digest(), _tensors(state, layout, local or {}), cfg, layout,
                    state.outer.name, tuple(sorted(local or {})), upload)


def write_checkpoint(directory: str | os.PathLike, state: CommittedState, cfg: RunConfig, layout: Layout, *,
                     local: dict[str, np.ndarray] | None = None, keep: int = 3) -> Checkpoint:
    """Write `state` as checkpoint `round-<state.rounds>` under `directory` (created if needed),
    atomically, then remove all but the newest `keep`. Returns the checkpoint.

    Raises OSError (full disk, unwritable directory: nothing partial is left behind) and
    ValueError when `layout` does not cover the parameters."""
    return write_snapshot(directory, snapshot(state, cfg, layout, local=local), keep=keep)


class _DirectoryLock:
    """An exclusive `flock` on `<root>/.lock` while a checkpoint is written there: one writer per
    directory across processes (the kernel drops it when its process dies)."""

    def __init__(self, root: pathlib.Path):
        self.path = root / ".lock"

    def __enter__(self) -> None:
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX)
        except BaseException:
            os.close(self.fd)
            raise

    def __exit__(self, *exc) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)


def write_snapshot(directory: str | os.PathLike, snap: Snapshot, *, keep: int = 3,
                   protect: frozenset[int] = frozenset()) -> Checkpoint:
    """Write `snap` as checkpoint `round-<snap.rounds>` under `directory` (created if needed):
    files in `.tmp-*`, each fsynced, renamed into place, the directory fsynced; then all but the
    newest `keep` removed, except the rounds in `protect` (one being uploaded). Holds the
    directory's lock meanwhile (waits for another process's write). Raises OSError (nothing
    partial is left behind)."""
    root = pathlib.Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    with _DirectoryLock(root):
        for stale in root.glob(".tmp-*"):  # abandoned by a process that died writing (we hold the lock)
            shutil.rmtree(stale, ignore_errors=True)
        tmp = root / f".tmp-{snap.rounds}-{os.getpid()}"
        final = root / f"{_PREFIX}{snap.rounds:08d}"
        try:
            tmp.mkdir()
            save_file(snap.tensors, str(tmp / STATE_FILE), metadata={"format": "shoal", "round": str(snap.rounds)})
            with open(tmp / STATE_FILE, "rb+") as f:
                os.fsync(f.fileno())
            manifest = {"format_version": FORMAT_VERSION, "round": snap.rounds, "digest": snap.digest.hex(),
                        "run_id": run_identity(snap.cfg), "run_config": json.loads(_config_json(snap.cfg)),
                        "model": describe_model(snap.layout, snap.outer),
                        "local": list(snap.local), "written_at": time.time(),
                        "files": [{"name": STATE_FILE, "bytes": (tmp / STATE_FILE).stat().st_size}]}
            _write_file(tmp / MANIFEST_FILE, json.dumps(manifest, indent=1, sort_keys=True).encode())
            _fsync_dir(tmp)
            if final.exists():  # the same round again (a restart): the new one replaces it
                shutil.rmtree(final)
            os.rename(tmp, final)
            _fsync_dir(root)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        for old in list_checkpoints(root)[keep:] if keep > 0 else ():
            if old.round not in protect:
                shutil.rmtree(old.path, ignore_errors=True)
    return Checkpoint(final, manifest)


def _round_dirs(root: pathlib.Path) -> list[pathlib.Path]:
    """Checkpoint directories under `root`, newest first (by the round in the name)."""
    if not root.is_dir():
        return []
    dirs = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(_PREFIX) and p.name[len(_PREFIX):].isdigit()]
    return sorted(dirs, key=lambda p: int(p.name[len(_PREFIX):]), reverse=True)


def read_manifest(path: pathlib.Path) -> Checkpoint:
    """The checkpoint in directory `path`; CheckpointError naming the file when its manifest is
    missing, unreadable or of another format version."""
    mf = path / MANIFEST_FILE
    try:
        manifest = json.loads(mf.read_text())
        version = manifest["format_version"]
        int(manifest["round"]), bytes.fromhex(manifest["digest"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{mf}: unreadable manifest ({exc})") from None
    if version != FORMAT_VERSION:
        raise CheckpointError(f"{mf}: format version {version}, this Shoal reads {FORMAT_VERSION}")
    return Checkpoint(path, manifest)


def list_checkpoints(directory: str | os.PathLike) -> list[Checkpoint]:
    """The checkpoints under `directory` whose manifest reads, newest first (no digest check)."""
    out = []
    for p in _round_dirs(pathlib.Path(directory)):
        try:
            out.append(read_manifest(p))
        except CheckpointError:
            continue
    return out


def load_tensors(ckpt: Checkpoint) -> dict[str, np.ndarray]:
    """The tensors of `ckpt`; CheckpointError naming the file when it is missing, of another size than
    the manifest says, or not a readable safetensors file."""
    f = ckpt.state_file
    want = {e["name"]: int(e["bytes"]) for e in ckpt.manifest.get("files", [])}.get(STATE_FILE)
    try:
        size = f.stat().st_size
        if want is not None and size != want:
            raise CheckpointError(f"{f}: {size} bytes, the manifest says {want} (truncated or overwritten)")
        return load_file(str(f))
    except CheckpointError:
        raise
    except Exception as exc:  # safetensors raises its own error types for a damaged header
        raise CheckpointError(f"{f}: unreadable ({exc})") from None


def state_of(ckpt: Checkpoint, tensors: dict[str, np.ndarray], cfg: RunConfig | None = None) -> CommittedState:
    """The committed state `tensors` hold, rebuilt with the manifest's layout and run configuration
    (or `cfg`); CheckpointError when a tensor is missing or of another shape."""
    cfg = cfg or RunConfig.from_json(json.dumps(ckpt.manifest["run_config"]))
    try:
        parts = [np.asarray(tensors[name], dtype=np.float32).reshape(-1) for name, _ in ckpt.manifest["model"]["layout"]]
        outer = make_outer_for(cfg)
        outer.load_state({k[len(OUTER_PREFIX):]: v for k, v in tensors.items() if k.startswith(OUTER_PREFIX)})
    except (KeyError, ValueError, TypeError, InvalidArgument) as exc:
        raise CheckpointError(f"{ckpt.state_file}: tensors do not match the manifest ({exc})") from None
    return CommittedState(np.concatenate(parts) if parts else np.zeros(0, np.float32), outer, ckpt.round)


def verify(ckpt: Checkpoint) -> CommittedState:
    """Load `ckpt` and check its digest; the state, or CheckpointError naming the damaged file."""
    state = state_of(ckpt, load_tensors(ckpt))
    if state.digest() != ckpt.digest:
        raise CheckpointError(f"{ckpt.state_file}: digest {state.digest().hex()[:16]} is not the recorded "
                              f"{ckpt.digest.hex()[:16]} (corrupted)")
    return state


def check_identity(ckpt: Checkpoint, cfg: RunConfig, layout: Layout) -> None:
    """CheckpointMismatch (one line naming both) when `ckpt` is of another run or model."""
    mine, theirs = run_identity(cfg), ckpt.manifest.get("run_id")
    if theirs != mine:
        raise CheckpointMismatch(f"checkpoint {ckpt.path} is of run {theirs}, this run is {mine}")
    want = describe_model(layout, make_outer_for(cfg).name)
    have = ckpt.manifest.get("model", {})
    if have.get("layout") != want["layout"] or have.get("outer") != want["outer"]:
        raise CheckpointMismatch(f"checkpoint {ckpt.path} holds model {_model_line(have)}, this run's model is "
                                 f"{_model_line(want)}")


def _model_line(model: dict) -> str:
    layout = model.get("layout") or []
    return f"{model.get('num_params')} params in {len(layout)} tensors, outer {model.get('outer')}"


def load_newest(directory: str | os.PathLike, cfg: RunConfig, layout: Layout, *,
                digests: dict[int, bytes] | None = None,
                ) -> tuple[CommittedState, Checkpoint, dict[str, np.ndarray]] | None:
    """The newest checkpoint under `directory` that passes its digest check (and, with `digests`
    (round -> committed digest), whose round and digest are recorded there): its state, the
    checkpoint, and its local-state tensors (names without the prefix). None when there is none.

    A damaged checkpoint is skipped for the previous one with a warning naming the file; one of
    another run or model raises CheckpointMismatch."""
    for path in _round_dirs(pathlib.Path(directory)):
        try:
            ckpt = read_manifest(path)
        except CheckpointError as exc:
            log.warning("skipping checkpoint: %s", exc)
            continue
        check_identity(ckpt, cfg, layout)
        if digests is not None and digests.get(ckpt.round) != ckpt.digest:
            log.warning("skipping checkpoint %s: round %d with digest %s is not a committed round the coordinator "
                        "recorded", path, ckpt.round, ckpt.digest.hex()[:16])
            continue
        try:
            tensors = load_tensors(ckpt)
            state = state_of(ckpt, tensors, cfg)
            if state.digest() != ckpt.digest:
                raise CheckpointError(f"{ckpt.state_file}: digest {state.digest().hex()[:16]} is not the recorded "
                                      f"{ckpt.digest.hex()[:16]} (corrupted)")
        except CheckpointError as exc:
            log.warning("skipping damaged checkpoint: %s; trying the previous one", exc)
            continue
        local = {k[len(LOCAL_PREFIX):]: v for k, v in tensors.items() if k.startswith(LOCAL_PREFIX)}
        return state, ckpt, local
    return None


def resume(workload, directory: str | os.PathLike) -> Checkpoint | None:
    """Make the newest verified checkpoint under `directory` the workload's committed state (and its
    local state, when the workload takes one), if it is newer than the state the workload has; the
    checkpoint, or None when there is none to resume from. A peer then says Ready with that round
    and digest: the coordinator takes it as up to date only when that is its last committed state
    (otherwise the peer syncs, as any stale peer). Raises CheckpointMismatch (another run or model)."""
    if not isinstance(workload.state, CommittedState):
        return None
    found = load_newest(directory, workload.cfg, param_layout(workload))
    if found is None or found[0].rounds <= workload.state.rounds:
        return None
    state, ckpt, local = found
    workload.apply(state)
    load_local = getattr(workload, "load_local_state", None)
    if local and load_local is not None:
        load_local(local)
    log.info("resuming from checkpoint %s: round %d, digest %s", ckpt.path, ckpt.round, ckpt.digest.hex()[:16])
    return ckpt


class Checkpointer:
    """Writes a peer's committed state every `every` rounds into `directory`, keeping `keep`, and
    uploads the checkpoints the peer is elected for to the shared store `url`.

    `submit(workload, upload=...)` after each commit (the agent's way, off the round's path): when a
    checkpoint is due (the state's round is a multiple of `every`, or an earlier due write failed)
    it takes a `Snapshot` at once and hands it to the writer thread, which writes it, fsyncs and
    renames it, then, when `upload`, hands it to the upload thread (peer.checkpoint_store). At most
    one write is in flight; a checkpoint due meanwhile waits in one slot, and a newer one replaces
    it there (counted in `superseded`, logged; its upload duty goes with it: the next elected
    checkpoint uploads). At most one upload runs, and it never holds the local writes back: a
    checkpoint written while an upload runs is not uploaded (a warning; the next elected one is),
    and the one being uploaded is kept from keep-last-K pruning until its upload ended.
    `committed(workload)` writes a due checkpoint in the caller's thread instead (same lock, same
    rules) and returns it. `flush(timeout)` waits for the writer to be idle; `close(timeout)` waits
    the same, then stops the thread: a write still in flight is abandoned (the thread is a daemon;
    a process exit mid-write leaves only a `.tmp-*` directory, never read as a checkpoint).

    Callbacks, called in the writer's thread (the caller hands them to its own loop):
    `on_written(ckpt)` once the checkpoint's files are fsynced and renamed (only then is its round
    durable), `on_uploaded(ckpt)` after an upload, `on_failed()` after a failed write or upload.
    Never raises: a failed write is a warning naming the cause, counted in `failures`, and retried
    at the next commit; a failed upload is a warning, and the next elected checkpoint tries again.
    `last_round`, `last_seconds`, `last_bytes`: of the last checkpoint written (-1 / 0 before any);
    `last_seconds` is the write's own time (fsync included), not the wait in the slot. `helper`:
    uploads run in a helper process at a lower CPU priority (checkpoint_store.Uploader; what a
    peer does), not in this interpreter."""

    def __init__(self, directory: str | os.PathLike, every: int, keep: int = 3, url: str | None = None, *,
                 on_written: Callable[[Checkpoint], None] | None = None,
                 on_uploaded: Callable[[Checkpoint], None] | None = None,
                 on_failed: Callable[[], None] | None = None, helper: bool = False):
        if every < 1:
            raise ValueError("checkpoint every: must be >= 1 round")
        self.directory = pathlib.Path(directory)
        self.every, self.keep = every, keep
        if url:
            url = checkpoint_store.check_url(url)
        self.url = url  # the shared checkpoint store (peer.checkpoint_store), None: local only
        self.on_written, self.on_uploaded, self.on_failed = on_written, on_uploaded, on_failed
        self.due = False
        self.failures = 0
        self.superseded = 0  # snapshots replaced in the slot by a newer one before they were written
        self.last_round, self.last_seconds, self.last_bytes = -1, 0.0, 0
        self.uploaded_round, self.upload_seconds = -1, 0.0  # of the last upload to `url`
        self._unsupported = False
        self._taken = -1  # the round of the newest snapshot taken
        self._cond = threading.Condition()  # guards the slot, `_busy`, `_closed`, `due`, the counters
        self._pending: Snapshot | None = None  # the slot: the next snapshot to write
        self._busy = False  # the writer is writing (or uploading) one
        self._writing_round = -1
        self._closed = False
        self._thread: threading.Thread | None = None
        self._to_upload: Checkpoint | None = None  # handed to the upload thread, not started yet
        self._uploading_round = -1  # the round the upload thread uploads now, -1: none
        self._up_thread: threading.Thread | None = None
        self._write_lock = threading.Lock()  # one writer in this process: the thread or `committed`
        self.helper = helper  # uploads in a helper process (checkpoint_store.Uploader), not in this one
        self._uploader: checkpoint_store.Uploader | None = None

    # ------------------------------------------------------------ taking a snapshot (caller's thread)

    def take(self, workload, upload: bool = False) -> Snapshot | None:
        """The snapshot of the workload's committed state when a checkpoint is due, else None.
        Never raises (a layout that does not fit is a failed checkpoint, retried)."""
        state = workload.state
        if not isinstance(state, CommittedState):
            if not self._unsupported:
                log.warning("checkpoints: the workload's state (%s) is not a flat committed state; none is written",
                            type(state).__name__)
                self._unsupported = True
            return None
        with self._cond:
            if state.rounds % self.every == 0 and state.rounds > max(self.last_round, self._taken):
                self.due = True
            if not self.due or state.rounds <= 0:
                return None
            self.due = False
            self._taken = state.rounds
        try:
            local_fn = getattr(workload, "local_state", None)
            return snapshot(state, workload.cfg, param_layout(workload), local=local_fn() if local_fn else None,
                            upload=upload)
        except ValueError as exc:
            self._failed(state.rounds, exc)
            return None

    def submit(self, workload, upload: bool = False) -> Snapshot | None:
        """After a commit: take the snapshot when a checkpoint is due and hand it to the writer
        thread (returns at once; the snapshot, or None when none is due). Never raises."""
        snap = self.take(workload, upload)
        if snap is None:
            return None
        with self._cond:
            if self._closed:
                log.warning("checkpoint of round %d not written: the checkpointer is closed", snap.rounds)
                return None
            if self._pending is not None:
                self.superseded += 1
                log.info("checkpoint of round %d superseded by round %d before it was written (a write still "
                         "runs)%s", self._pending.rounds, snap.rounds,
                         "; its upload goes with it" if self._pending.upload else "")
            self._pending = snap
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="shoal-checkpoint-writer", daemon=True)
                self._thread.start()
            self._cond.notify_all()
        return snap

    def committed(self, workload) -> Checkpoint | None:
        """Write a due checkpoint in the caller's thread (no upload); the checkpoint, or None (none
        due, or the write failed: a warning, retried at the next commit). Never raises."""
        snap = self.take(workload)
        return None if snap is None else self._write(snap)

    # ------------------------------------------------------------ the writer

    @property
    def writing(self) -> int:
        """The round of the snapshot being written or uploaded now, -1 when the writer is idle."""
        with self._cond:
            return self._writing_round if self._busy else -1

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._pending is None and not self._closed:
                    self._cond.wait()
                if self._pending is None:  # closed and nothing left
                    return
                snap, self._pending = self._pending, None
                self._busy, self._writing_round = True, snap.rounds
            try:
                ckpt = self._write(snap)
                if ckpt is not None and snap.upload and self.url:
                    self._hand_to_uploader(ckpt)
            except Exception:  # a callback's own error: the writer goes on with the next snapshot
                log.exception("checkpoint writer: a callback for round %d failed", snap.rounds)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _write(self, snap: Snapshot) -> Checkpoint | None:
        t0 = time.monotonic()
        with self._cond:
            protect = frozenset(r for r in (self._uploading_round,
                                            self._to_upload.round if self._to_upload is not None else -1) if r >= 0)
        try:
            with self._write_lock:
                ckpt = write_snapshot(self.directory, snap, keep=self.keep, protect=protect)
        except OSError as exc:
            self._failed(snap.rounds, exc)
            return None
        with self._cond:
            self.last_round, self.last_seconds, self.last_bytes = snap.rounds, time.monotonic() - t0, ckpt.bytes
        log.info("checkpoint of round %d written to %s (%.1f kB, %.3fs)", snap.rounds, ckpt.path,
                 ckpt.bytes / 1e3, self.last_seconds)
        if self.on_written is not None:
            self.on_written(ckpt)
        return ckpt

    def _hand_to_uploader(self, ckpt: Checkpoint) -> None:
        with self._cond:
            if self._closed:
                return
            if self._uploading_round >= 0 or self._to_upload is not None:
                log.warning("checkpoint of round %d not uploaded: the upload of round %d still runs (the next elected "
                            "checkpoint is uploaded)", ckpt.round, max(self._uploading_round,
                                                                      getattr(self._to_upload, "round", -1)))
                return
            self._to_upload = ckpt
            if self._up_thread is None:
                self._up_thread = threading.Thread(target=self._run_uploads, name="shoal-checkpoint-uploader",
                                                   daemon=True)
                self._up_thread.start()
            self._cond.notify_all()

    def _run_uploads(self) -> None:
        while True:
            with self._cond:
                while self._to_upload is None and not self._closed:
                    self._cond.wait()
                if self._to_upload is None:
                    return
                ckpt, self._to_upload = self._to_upload, None
                self._uploading_round = ckpt.round
            try:
                self.upload(ckpt)
            except Exception:  # a callback's own error
                log.exception("checkpoint uploader: a callback for round %d failed", ckpt.round)
            finally:
                with self._cond:
                    self._uploading_round = -1
                    self._cond.notify_all()

    @property
    def uploading(self) -> int:
        """The round being uploaded now, -1 when none."""
        with self._cond:
            return self._uploading_round

    def _failed(self, rounds: int, exc: Exception) -> None:
        with self._cond:
            self.failures += 1
            if self._pending is None:  # a newer snapshot waiting is the retry already
                self.due = True
        log.warning("checkpoint of round %d into %s failed (%s); retried at the next commit", rounds,
                    self.directory, exc)
        if self.on_failed is not None:
            self.on_failed()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait up to `timeout` seconds (None: no bound) until no snapshot waits or is written and
        no upload waits or runs; True when both threads are idle."""
        with self._cond:
            return self._cond.wait_for(lambda: self._pending is None and not self._busy and self._to_upload is None
                                       and self._uploading_round < 0, timeout)

    def close(self, timeout: float | None = None) -> bool:
        """Wait up to `timeout` seconds for the writer (`flush`), then stop it. True when every
        snapshot taken was written (or failed, with its warning); False when a write was abandoned:
        one warning naming its round (a waiting snapshot is dropped; one in flight finishes or,
        at the process's exit, leaves only a `.tmp-*` directory, never read as a checkpoint)."""
        idle = self.flush(timeout)
        with self._cond:
            self._closed = True
            if not idle:
                left = [r for r in ((self._writing_round if self._busy else None),
                                    (self._pending.rounds if self._pending is not None else None)) if r is not None]
                ups = [r for r in (self._uploading_round, getattr(self._to_upload, "round", -1)) if r >= 0]
                log.warning("checkpoint writes of rounds %s and uploads of rounds %s abandoned after %.0fs: the last "
                            "written is round %d", left, ups, timeout or 0.0, self.last_round)
                self._pending = self._to_upload = None
            self._cond.notify_all()
        if idle and self._uploader is not None:
            self._uploader.close()
        return idle

    # ------------------------------------------------------------ the shared store

    def fetch_from_store(self) -> list[int]:
        """Copy the shared store's checkpoints newer than the newest local one into the directory
        (before `resume`); the rounds copied, [] without a store or when it fails (a warning)."""
        if not self.url:
            return []
        if self.helper and self._uploader is None:  # it imports its S3 client while the peer starts
            self._uploader = checkpoint_store.Uploader()
            self._uploader.start()
        local = list_checkpoints(self.directory)
        try:
            return checkpoint_store.download_newer(self.url, self.directory, local[0].round if local else -1)
        except checkpoint_store.StoreError as exc:
            log.warning("%s; resuming from the local checkpoints only", exc)
            return []

    def upload(self, ckpt: Checkpoint) -> bool:
        """Upload `ckpt` to the shared store (an elected checkpointer's, after its local write; the
        writer thread does it for a snapshot submitted with `upload`). Never raises: a failure is a
        warning, counted in `failures`; the next checkpoint tries again."""
        t0 = time.monotonic()
        try:
            if self.helper:
                if self._uploader is None:
                    self._uploader = checkpoint_store.Uploader()
                where = self._uploader.upload(ckpt.path, self.url, self.keep)
            else:
                where = checkpoint_store.upload(ckpt.path, self.url, self.keep)
        except checkpoint_store.StoreError as exc:
            with self._cond:
                self.failures += 1
            log.warning("%s; the next checkpoint tries again", exc)
            if self.on_failed is not None:
                self.on_failed()
            return False
        self.uploaded_round, self.upload_seconds = ckpt.round, time.monotonic() - t0
        log.info("checkpoint of round %d uploaded to %s (%.3fs)", ckpt.round, where, self.upload_seconds)
        if self.on_uploaded is not None:
            self.on_uploaded(ckpt)
        return True


def export(ckpt: Checkpoint, out: str | os.PathLike, fmt: str = "safetensors",
           names: Sequence[str] | None = None) -> pathlib.Path:
    """Write the verified parameters of `ckpt` (by their workload names; `names` keeps only those)
    to one file: `safetensors`, or `torch` (a `state_dict` of tensors for `torch.load`, needs torch).
    CheckpointError when the checkpoint is damaged; ImportError for `torch` without torch."""
    verify(ckpt)
    tensors = load_tensors(ckpt)
    params = {n: tensors[n] for n, _ in ckpt.manifest["model"]["layout"] if names is None or n in names}
    path = pathlib.Path(out)
    if fmt == "safetensors":
        save_file(params, str(path), metadata={"format": "shoal", "round": str(ckpt.round),
                                               "digest": ckpt.manifest["digest"]})
    elif fmt == "torch":
        import torch  # optional dependency: only this export needs it

        torch.save({n: torch.from_numpy(np.array(v)) for n, v in params.items()}, path)
    else:
        raise ValueError(f"export format {fmt!r} is not safetensors or torch")
    return path
