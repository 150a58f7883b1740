"""The swarm's shared checkpoint store: `file://DIR` or S3-compatible `s3://BUCKET/PREFIX`.

Elected checkpointers (the participants each commit names, `pb.Commit.checkpointers`) upload
their local checkpoint (peer.checkpoints: `round-NNNNNNNN/` with `state.safetensors` and
`manifest.json`) to `URL/round-NNNNNNNN/`; a restarted peer whose own checkpoint directory
holds nothing newer downloads the newest one from there, verifies it like a local one, and
resumes from it.

Through fsspec (`s3fs` for s3://, a maintained client on botocore). Credentials and the endpoint
come from the usual places, never from the command line: `AWS_ACCESS_KEY_ID`,
`AWS_SECRET_ACCESS_KEY`, `AWS_ENDPOINT_URL` (an S3-compatible server such as SeaweedFS or MinIO),
`AWS_REGION`, or `~/.aws/credentials` / `AWS_SHARED_CREDENTIALS_FILE`.

Atomicity: the state file is uploaded first and the manifest last; a checkpoint without its
manifest is not listed, so a reader never takes a half-uploaded one (a manifest of a state file
that was overwritten since fails the digest check and is skipped). Failures: every function here
raises `StoreError` (one line naming the URL and the cause) for an unreachable or refusing
store; the caller (`Checkpointer`) turns that into a warning and a retry at the next checkpoint.

`Uploader` runs the uploads in a helper process (`python -m shoal.peer.checkpoint_store`, at a
lower CPU priority, the environment and so the credentials inherited, nothing on its command line):
the S3 client's work (request signing, its own I/O thread) then competes with the rounds neither
for the peer's interpreter lock nor, on a busy host, for its CPU share. The helper exits when the
peer's end of its pipe closes (the peer exits, or is killed).
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import select
import shutil
import subprocess
import sys
import threading

log = logging.getLogger("shoal.peer.checkpoint_store")

# The layout of a checkpoint directory (peer.checkpoints writes it): `round-NNNNNNNN/` holding
# the state file and the manifest, which is written (and uploaded) last.
ROUND_PREFIX = "round-"
STATE_FILE = "state.safetensors"
MANIFEST_FILE = "manifest.json"
_PREFIX = ROUND_PREFIX

SCHEMES = ("file://", "s3://")


class StoreError(Exception):
    """The shared checkpoint store could not be read or written (unreachable, refused, missing)."""


def check_url(url: str) -> str:
    """`url` when it is a file:// or s3://BUCKET[/PREFIX] URL; ValueError naming it otherwise."""
    rest = url.split("://", 1)[1] if "://" in url else ""
    if not url.startswith(SCHEMES) or not rest.strip("/") or url.startswith("s3:///"):
        raise ValueError(f"checkpoint_url: {url!r} is not file://DIR or s3://BUCKET/PREFIX")
    return url.rstrip("/")


def _fs(url: str):
    """(fsspec filesystem, root path) of `url`. ImportError names the extra for s3:// without s3fs."""
    import fsspec

    if url.startswith("s3://"):
        try:
            import s3fs  # noqa: F401 - fsspec's s3 implementation
        except ImportError as exc:
            raise ImportError("s3:// checkpoint stores need s3fs: pip install 'shoal[s3]'") from exc
    fs, root = fsspec.core.url_to_fs(url)
    return fs, root.rstrip("/")


def _rounds(fs, root: str) -> list[int]:
    """Rounds of the checkpoints whose manifest is in the store, newest first."""
    try:
        names = [p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(root, detail=False)] if fs.exists(root) else []
    except FileNotFoundError:
        return []
    out = []
    for n in names:
        if n.startswith(_PREFIX) and n[len(_PREFIX):].isdigit() and fs.exists(f"{root}/{n}/{MANIFEST_FILE}"):
            out.append(int(n[len(_PREFIX):]))
    return sorted(out, reverse=True)


def upload(path: pathlib.Path, url: str, keep: int = 3) -> str:
    """Copy the checkpoint directory `path` (`round-NNNNNNNN`) to `url` (state file first,
    manifest last), then remove all but the newest `keep` there; the checkpoint's URL. Raises
    StoreError."""
    fs, root = _fs(url)
    dest = f"{root}/{path.name}"
    try:
        fs.makedirs(dest, exist_ok=True)
        fs.put_file(str(path / STATE_FILE), f"{dest}/{STATE_FILE}")
        fs.put_file(str(path / MANIFEST_FILE), f"{dest}/{MANIFEST_FILE}")
        for old in _rounds(fs, root)[keep:] if keep > 0 else ():
            fs.rm(f"{root}/{_PREFIX}{old:08d}", recursive=True)
    except (OSError, ValueError) as exc:  # botocore's errors are OSErrors through s3fs; so are file:// ones
        raise StoreError(f"checkpoint store {url}: upload of {path.name} failed ({exc})") from None
    return f"{url}/{path.name}"


def download_newer(url: str, directory: str | os.PathLike, than: int) -> list[int]:
    """Copy every checkpoint in the store newer than round `than` into `directory` (as
    `round-NNNNNNNN/`, written in a temporary directory and renamed: a local reader never sees half
    of one), newest first, for `peer.checkpoints.load_newest` to verify and choose from; the rounds
    copied. Raises StoreError."""
    fs, root = _fs(url)
    local = pathlib.Path(directory)
    local.mkdir(parents=True, exist_ok=True)
    got = []
    try:
        for r in _rounds(fs, root):
            if r <= than:
                break
            name = f"{_PREFIX}{r:08d}"
            final = local / name
            if final.exists():
                continue
            tmp = local / f".tmp-store-{r}-{os.getpid()}"
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
            try:
                fs.get_file(f"{root}/{name}/{STATE_FILE}", str(tmp / STATE_FILE))
                fs.get_file(f"{root}/{name}/{MANIFEST_FILE}", str(tmp / MANIFEST_FILE))
                json.loads((tmp / MANIFEST_FILE).read_text())
                os.rename(tmp, final)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
            got.append(r)
    except (OSError, ValueError) as exc:
        raise StoreError(f"checkpoint store {url}: download failed ({exc})") from None
    if got:
        log.info("fetched checkpoints of rounds %s from the checkpoint store %s", got, url)
    return got


HELPER_NICE = 10  # the helper process's CPU priority below the peer's (os.nice)
UPLOAD_TIMEOUT_SECONDS = 120.0  # an upload the helper has not finished by then fails (the helper is restarted)


class Uploader:
    """`upload` (same arguments, result and StoreError) in a helper process, one upload at a time.

    Started at the first upload; a helper that died or did not answer within `timeout` seconds
    fails that upload (StoreError) and is started afresh for the next. `close()` ends it."""

    def __init__(self, timeout: float = UPLOAD_TIMEOUT_SECONDS):
        self.timeout = timeout
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()

    def start(self) -> None:
        """Start the helper now (a peer does at its start: the first upload then finds it ready)."""
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self._proc = self._start()

    def _start(self) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "shoal.peer.checkpoint_store"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=None, text=True, bufsize=1)

    def upload(self, path: pathlib.Path, url: str, keep: int = 3) -> str:
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self._proc = self._start()
            proc = self._proc
            try:
                proc.stdin.write(json.dumps({"path": str(path), "url": url, "keep": keep}) + "\n")
                proc.stdin.flush()
                ready, _, _ = select.select([proc.stdout], [], [], self.timeout)
                line = proc.stdout.readline() if ready else ""
            except (OSError, ValueError) as exc:
                line, why = "", f"the upload helper failed ({exc})"
            else:
                why = "the upload helper exited" if ready else f"the upload helper did not answer in {self.timeout:.0f}s"
            if not line:
                self._stop(proc)
                raise StoreError(f"checkpoint store {url}: upload of {path.name} failed ({why})")
            reply = json.loads(line)
            if "error" in reply:
                raise StoreError(reply["error"])
            return reply["where"]

    def _stop(self, proc: subprocess.Popen) -> None:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)
        if self._proc is proc:
            self._proc = None

    def close(self) -> None:
        """End the helper (it finishes nothing more); safe to call more than once."""
        proc = self._proc
        if proc is not None:
            try:
                proc.stdin.close()
                proc.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired):
                pass
            self._stop(proc)


def _serve() -> None:
    """The helper's loop: one JSON request a line on stdin ({path, url, keep}), one reply a line
    on stdout ({where} or {error}); ends at the end of stdin."""
    try:
        os.nice(HELPER_NICE)
    except OSError:
        pass
    try:
        import s3fs  # noqa: F401 - imported now, while the peer starts, not at the first upload
    except ImportError:
        pass
    for line in sys.stdin:
        req = json.loads(line)
        try:
            reply = {"where": upload(pathlib.Path(req["path"]), req["url"], int(req["keep"]))}
        except StoreError as exc:
            reply = {"error": str(exc)}
        except Exception as exc:  # noqa: BLE001 - anything else fails this upload, not the helper
            reply = {"error": f"checkpoint store {req.get('url')}: upload failed ({type(exc).__name__}: {exc})"}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    _serve()
