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
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import shutil

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
