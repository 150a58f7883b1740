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

Failure semantics: `write_checkpoint` raises OSError (full disk, unwritable directory) and leaves no
partial checkpoint; `Checkpointer.committed` never raises: a failed write is a warning, counted, and
retried at the next commit. `load_newest` skips a damaged newest checkpoint for the previous one
with a warning naming the file, and raises CheckpointMismatch (one line naming both) for a
checkpoint of another run or model. Only `FlatStateWorkload` states (`CommittedState`) are
checkpointed. Pure file I/O; tested without processes (tests/test_checkpoints.py).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import pathlib
import shutil
import time
from collections.abc import Sequence
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
        out[name] = np.ascontiguousarray(state.params[off:off + n].reshape(shape))
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


def write_checkpoint(directory: str | os.PathLike, state: CommittedState, cfg: RunConfig, layout: Layout, *,
                     local: dict[str, np.ndarray] | None = None, keep: int = 3) -> Checkpoint:
    """Write `state` as checkpoint `round-<state.rounds>` under `directory` (created if needed),
    atomically, then remove all but the newest `keep`. Returns the checkpoint.

    Raises OSError (full disk, unwritable directory: nothing partial is left behind) and
    ValueError when `layout` does not cover the parameters."""
    root = pathlib.Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(".tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    tensors = _tensors(state, layout, local or {})
    tmp = root / f".tmp-{state.rounds}-{os.getpid()}"
    final = root / f"{_PREFIX}{state.rounds:08d}"
    try:
        tmp.mkdir()
        save_file(tensors, str(tmp / STATE_FILE), metadata={"format": "shoal", "round": str(state.rounds)})
        with open(tmp / STATE_FILE, "rb+") as f:
            os.fsync(f.fileno())
        manifest = {"format_version": FORMAT_VERSION, "round": state.rounds, "digest": state.digest().hex(),
                    "run_id": run_identity(cfg), "run_config": json.loads(_config_json(cfg)),
                    "model": describe_model(layout, state.outer.name),
                    "local": sorted(local or {}), "written_at": time.time(),
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
    """Writes a peer's committed state every `every` rounds into `directory`, keeping `keep`.

    `committed(workload)` after each commit: writes when the state's round is a multiple of
    `every` (or an earlier due write failed). `upload(ckpt)`: copies it to the shared store `url`
    (peer.checkpoint_store), what an elected checkpointer does next, off the round's path. Never raises: a failed write is a warning naming the cause,
    counted in `failures`, and retried at the next commit. `last_round`, `last_seconds`,
    `last_bytes`: of the last checkpoint written (-1 / 0 before any)."""

    def __init__(self, directory: str | os.PathLike, every: int, keep: int = 3, url: str | None = None):
        if every < 1:
            raise ValueError("checkpoint every: must be >= 1 round")
        self.directory = pathlib.Path(directory)
        self.every, self.keep = every, keep
        if url:
            url = checkpoint_store.check_url(url)
        self.url = url  # the shared checkpoint store (peer.checkpoint_store), None: local only
        self.due = False
        self.failures = 0
        self.last_round, self.last_seconds, self.last_bytes = -1, 0.0, 0
        self.uploaded_round, self.upload_seconds = -1, 0.0  # of the last upload to `url`
        self._unsupported = False

    def fetch_from_store(self) -> list[int]:
        """Copy the shared store's checkpoints newer than the newest local one into the directory
        (before `resume`); the rounds copied, [] without a store or when it fails (a warning)."""
        if not self.url:
            return []
        local = list_checkpoints(self.directory)
        try:
            return checkpoint_store.download_newer(self.url, self.directory, local[0].round if local else -1)
        except checkpoint_store.StoreError as exc:
            log.warning("%s; resuming from the local checkpoints only", exc)
            return []

    def upload(self, ckpt: Checkpoint) -> bool:
        """Upload `ckpt` to the shared store (an elected checkpointer's, after its local write).
        Never raises: a failure is a warning, counted in `failures`; the next checkpoint tries again."""
        t0 = time.monotonic()
        try:
            where = checkpoint_store.upload(ckpt.path, self.url, self.keep)
        except checkpoint_store.StoreError as exc:
            self.failures += 1
            log.warning("%s; the next checkpoint tries again", exc)
            return False
        self.uploaded_round, self.upload_seconds = ckpt.round, time.monotonic() - t0
        log.info("checkpoint of round %d uploaded to %s (%.3fs)", ckpt.round, where, self.upload_seconds)
        return True

    def committed(self, workload) -> Checkpoint | None:
        state = workload.state
        if not isinstance(state, CommittedState):
            if not self._unsupported:
                log.warning("checkpoints: the workload's state (%s) is not a flat committed state; none is written",
                            type(state).__name__)
                self._unsupported = True
            return None
        if state.rounds % self.every == 0 and state.rounds > self.last_round:
            self.due = True
        if not self.due or state.rounds <= 0:
            return None
        t0 = time.monotonic()
        try:
            local_fn = getattr(workload, "local_state", None)
            ckpt = write_checkpoint(self.directory, state, workload.cfg, param_layout(workload),
                                    local=local_fn() if local_fn else None, keep=self.keep)
        except (OSError, ValueError) as exc:
            self.failures += 1
            log.warning("checkpoint of round %d into %s failed (%s); retried at the next commit", state.rounds,
                        self.directory, exc)
            return None
        self.due = False
        self.last_round, self.last_seconds, self.last_bytes = state.rounds, time.monotonic() - t0, ckpt.bytes
        log.info("checkpoint of round %d written to %s (%.1f kB, %.3fs)", state.rounds, ckpt.path,
                 ckpt.bytes / 1e3, self.last_seconds)
        return ckpt


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
