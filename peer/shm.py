"""The shared-memory lane of the data plane: tensor chunks between peers on the same host.

Two peers on one machine (several GPUs per box, each with its own peer; a test swarm on
loopback) need not push tensor bytes through gRPC and the kernel's socket buffers: the sender
writes each chunk's bytes once into a segment in /dev/shm and sends, on the usual PushChunks
stream, a chunk message whose `shm_name`/`shm_offset` say where they are (`data` left empty).
Everything else is unchanged: the stream is signed and ticketed, and every chunk is checked
against the plan before its bytes are looked at. This is the intra-node transport NCCL calls SHM; the lane is chosen per remote
address, only after a probe proved that the receiver reads this sender's segments (same host and
same /dev/shm, e.g. not two containers with private /dev/shm), and otherwise the bytes go inline.

Segments: a `SegmentWriter` per receiver allocates slabs named `shoal-<first 16 hex of the
sender id>-<random, 16 hex>`, mode 0600, growing 1, 2, 4, ... MiB up to `SLAB_BYTES` (or one
chunk, if larger; a reduce-scatter lap's writer has one slab of a fixed size, `fixed`), and
reuses them stream after stream (fresh tmpfs pages cost a page fault each:
rewriting touched pages is several times faster). A slab's pages are reserved when it is created
(posix_fallocate), so a full /dev/shm is an OSError there, and the stream falls back to the socket;
a host needs about 2(p-1) x the tensor size of /dev/shm per peer for the lane (Docker's default of
64 MB is too small for large models: the lane then simply is not used). A writer goes back to its
pool only after a stream completed (the receiver acknowledged every chunk); after a failed stream
it is closed, never rewritten. Slabs are unlinked when the transport closes. The receiver
(`SegmentReader`, one per sender) opens a slab without following links and without blocking
(a FIFO planted under a valid name cannot stall it), checks that it is a regular file of bounded
size named with the sender's id and owned by the same user, and maps it read-only. A peer killed
with SIGKILL leaves its slabs in /dev/shm; `remove_stale` deletes them when a process with the
same identity starts again, and launchers (`shoal swarm`, `shoal bench`, the tests) call
`remove_stale_of_keys` for the peers they killed.

Fewer copies and bounded memory (docs/performance.md, "Shared-memory lane: fewer copies"): a
collective's result buffer can itself be a segment of its sender (`create_segment`, pooled by
`peer.dataplane.Transport.take_result`), so chunks sent from it need no slab at all; a writer
going back to its pool keeps only the slabs its last use wrote (`SegmentWriter.trim`); and a
receiver drops its mapping of a chunk's pages once consumed (`release`), so shared pages are
counted in the sender's resident size only.

Raises (receiver side) `InvalidArgument` naming the field (`shm_name`, `shm_offset`) for a name,
size or range that does not fit; the caller turns it into INVALID_ARGUMENT.
"""

from __future__ import annotations

import mmap
import os
import re
import secrets
import stat

import numpy as np

from shoal.common.errors import InvalidArgument, require

SHM_DIR = "/dev/shm"
FIRST_SLAB_BYTES = 1 << 20  # slabs grow 1, 2, 4, ... MiB (or one chunk), up to SLAB_BYTES
SLAB_BYTES = 64 << 20
MAX_SEGMENT_BYTES = 1 << 30  # a receiver refuses to map anything larger
NONCE_BYTES = 32
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux >= 5.14 (Python 3.11 lacks the name)
_NAME = re.compile(r"shoal-([0-9a-f]{16})-[0-9a-f]{16}")  # used with fullmatch


def available() -> bool:
    """True where POSIX shared memory is a directory we can write (Linux /dev/shm)."""
    return os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK | os.X_OK)


def _prefix(peer_id: str) -> str:
    return peer_id[:16].lower()


def _create(peer_id: str, size: int, populate: bool = False) -> tuple[str, mmap.mmap]:
    """A new slab of `size` bytes, its pages reserved now: a full /dev/shm raises OSError (ENOSPC)
    here, where the caller falls back to the socket, instead of SIGBUS on a later write. With
    `populate` (a segment that will be written whole) its pages are also mapped now (`_populate`)."""
    name = f"shoal-{_prefix(peer_id)}-{secrets.token_hex(8)}"
    fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.posix_fallocate(fd, 0, size)
        mm = mmap.mmap(fd, size)
        if populate:
            _populate(mm)
        return name, mm
    except BaseException:
        _unlink(name)
        raise
    finally:
        os.close(fd)


def _populate(mm: mmap.mmap) -> None:
    """Map every page of a new writable segment in one call (madvise MADV_POPULATE_WRITE, Linux
    >= 5.14) instead of one page fault per 4 KiB page at its first write: ~20 % less CPU for a
    fresh 64 MB segment here (39 against 48 ms), more when several processes fault at once. The
    pages are written whole right after anyway (a result buffer), so the resident size is
    the same. Where the kernel lacks it, the first writes fault as before."""
    try:
        mm.madvise(MADV_POPULATE_WRITE)
    except (OSError, ValueError):
        pass


def create_segment(peer_id: str, nbytes: int) -> tuple[str, mmap.mmap]:
    """A new segment of this peer of `nbytes` bytes that co-located receivers read by name, mapped
    read-write, its pages mapped now (e.g. a collective's result buffer, written whole: chunks
    sent from it need no slab and no copy). Its pages are reserved now: OSError when /dev/shm is
    full. The caller unlinks it (`unlink`)."""
    return _create(peer_id, nbytes, populate=True)


def unlink(name: str) -> None:
    """Remove segment `name` from /dev/shm (mappings stay valid); a missing one is no error."""
    _unlink(name)


def _unlink(name: str) -> None:
    try:
        os.unlink(os.path.join(SHM_DIR, name))
    except FileNotFoundError:
        pass


def remove_stale(peer_id: str) -> int:
    """Delete this identity's slabs left by a previous process (killed mid-stream); returns how many."""
    if not peer_id or not available():
        return 0
    removed = 0
    prefix = f"shoal-{_prefix(peer_id)}-"
    for name in os.listdir(SHM_DIR):
        if name.startswith(prefix) and _NAME.fullmatch(name):
            _unlink(name)
            removed += 1
    return removed


def remove_stale_of_keys(directory, *, recursive: bool = False) -> int:
    """`remove_stale` for the identity of every Ed25519 key file (*.key) in `directory` (and its
    subdirectories with `recursive`: peers that keep their key in a data directory under it):
    what a launcher (`shoal swarm`, the tests) calls after killing its peers. Returns slabs
    removed."""
    import pathlib

    from shoal.common.identity import load_or_create_key, peer_id_of, public_bytes

    removed = 0
    root = pathlib.Path(directory)
    for path in sorted(root.rglob("*.key") if recursive else root.glob("*.key")):
        try:
            removed += remove_stale(peer_id_of(public_bytes(load_or_create_key(path))))
        except (ValueError, OSError):
            continue  # not a key of ours
    return removed


class SegmentWriter:
    """The sender's slabs towards one receiver: `put(buffer) -> (name, offset)` copies the bytes
    once into a slab. A writer is reused stream after stream (`rewind()`), so its pages are
    touched once, not per round; `close()` unmaps and unlinks every slab (idempotent)."""

    def __init__(self, peer_id: str, slab_bytes: int = SLAB_BYTES, first_slab_bytes: int = FIRST_SLAB_BYTES):
        self.peer_id = peer_id
        self.slab_bytes = slab_bytes
        self.first_slab_bytes = min(first_slab_bytes, slab_bytes)
        self._slabs: list[tuple[str, mmap.mmap]] = []
        self._slab = 0  # index of the slab being filled
        self._used = 0  # bytes used in it
        self._reach = 0  # slabs written since the last `trim` (the others are idle)
        # Slabs of one size (`first_slab_bytes == slab_bytes`): that size; 0 for growing slabs.
        self.fixed = slab_bytes if self.first_slab_bytes == slab_bytes else 0

    def rewind(self) -> None:
        """Start over at the first slab (the receiver has read everything written so far)."""
        self._slab = self._used = 0

    def put(self, data) -> tuple[str, int]:
        """Copy `data` (any C-contiguous buffer) into a slab; returns (segment name, byte offset)."""
        view = memoryview(data).cast("B")
        n = view.nbytes
        while self._slab < len(self._slabs) and self._used + n > len(self._slabs[self._slab][1]):
            self._slab, self._used = self._slab + 1, 0
        if self._slab == len(self._slabs):
            grown = min(self.slab_bytes, self.first_slab_bytes << len(self._slabs))
            self._slabs.append(_create(self.peer_id, max(grown, n)))
        name, mm = self._slabs[self._slab]
        self._reach = max(self._reach, self._slab + 1)
        off = self._used
        mm[off:off + n] = view
        self._used += n
        return name, off

    def close(self) -> None:
        for name, mm in self._slabs:
            _unlink(name)
            mm.close()
        self._slabs.clear()
        self.rewind()

    def trim(self) -> None:
        """Unlink and unmap the slabs not written since the last trim (a writer going back to its
        pool keeps what its last use needed, not what one unusual stream once did: a round whose
        lanes were not known yet, a larger tensor). A receiver's mapping of a trimmed slab stays
        valid until it drops it (`SegmentReader` prunes unlinked ones)."""
        for name, mm in self._slabs[self._reach:]:
            _unlink(name)
            mm.close()
        del self._slabs[self._reach:]
        self._reach = 0
        self.rewind()


class SegmentReader:
    """The receiver's mappings of one sender's slabs: `read(name, offset, n)` -> read-only view.

    Views, not copies: the sender rewrites a slab only in a later stream to this receiver, which
    it opens only after this receiver's collective consumed the earlier one (the next round
    needs this receiver's vote; a retry follows an abort that makes the old attempt's chunks
    void). A misbehaving sender of the same user can still change or truncate its slab while
    the receiver reads it, so the collectives check received values only after copying them into
    their own memory (see peer.collectives), and a truncated slab is at worst a SIGBUS, which a
    process of the same user can cause anyway (kill(2)). Mappings are kept for the sender's next
    streams, at most `max_maps`, least recently used dropped first.
    """

    def __init__(self, sender: str, max_maps: int = 16):
        self.sender = sender
        self.max_maps = max_maps
        self._maps: dict[str, mmap.mmap] = {}

    def _open(self, name: str) -> mmap.mmap:
        m = _NAME.fullmatch(name)
        require(m is not None, "shm_name", f"{name[:60]!r} is not a shoal segment name")
        require(m.group(1) == _prefix(self.sender), "shm_name", "names a segment of another peer")
        try:  # O_NONBLOCK: opening a FIFO planted under a valid name must not block the event loop
            fd = os.open(os.path.join(SHM_DIR, name), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError as exc:
            raise InvalidArgument(f"shm_name: cannot open {name}: {exc.strerror}") from None
        try:
            st = os.fstat(fd)
            require(stat.S_ISREG(st.st_mode), "shm_name", "is not a regular file")
            require(st.st_uid == os.geteuid(), "shm_name", "belongs to another user")
            require(0 < st.st_size <= MAX_SEGMENT_BYTES, "shm_name", f"segment of {st.st_size} bytes")
            mm = mmap.mmap(fd, st.st_size, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        while len(self._maps) >= self.max_maps:
            _close(self._maps.pop(next(iter(self._maps))))
        self._maps[name] = mm
        return mm

    def read(self, name: str, offset: int, n: int) -> memoryview:
        """A read-only view of `n` bytes at `offset` of segment `name` (mapped on first use)."""
        mm = self._maps.pop(name, None)
        if mm is None:
            self._prune()
            mm = self._open(name)
        self._maps[name] = mm  # most recently used last
        require(offset + n <= len(mm), "shm_offset", f"{offset} + {n} bytes past the segment's {len(mm)}")
        return memoryview(mm)[offset:offset + n]

    def _prune(self) -> None:
        """Drop the mappings of segments the sender unlinked (last attempts' result buffers): a
        mapping would keep their memory alive after the sender let it go."""
        for name in [n for n in self._maps if not os.path.exists(os.path.join(SHM_DIR, n))]:
            _close(self._maps.pop(name))

    def close(self) -> None:
        for mm in self._maps.values():
            _close(mm)
        self._maps.clear()


def _close(mm: mmap.mmap) -> None:
    """Unmap now, or, while views of it are still alive, when the last one goes."""
    try:
        mm.close()
    except BufferError:
        pass


def release(values) -> bool:
    """Drop this process's mapping of the whole pages under `values`, a received chunk read
    through a `SegmentReader` (a read-only view of another peer's segment), once the collective
    consumed it; True when it did. The bytes stay in the segment, which is the sender's memory
    (counted in the sender's resident size, where it belongs): only this process's page-table
    entries go (madvise MADV_DONTNEED on a shared read-only file mapping never discards data; a
    later read, the next round's, maps the same pages again). Without it a receiver keeps every
    page it ever read of every sender's slabs resident in its own RSS as well: the slab memory
    counted twice, in both processes. Anything else (an array of this process's own memory, an
    encoded chunk) is left alone: False."""
    base = values.base if isinstance(values, np.ndarray) else None
    if not isinstance(base, memoryview) or not base.readonly or not isinstance(base.obj, mmap.mmap):
        return False
    start = values.__array_interface__["data"][0]
    page = mmap.PAGESIZE
    lo, hi = -(-start // page) * page, (start + values.nbytes) // page * page  # whole pages inside
    if hi <= lo:
        return False
    mm = base.obj
    at = np.frombuffer(mm, dtype=np.uint8, count=1).__array_interface__["data"][0]  # the mapping's address
    try:
        mm.madvise(mmap.MADV_DONTNEED, lo - at, hi - lo)
    except (OSError, ValueError):  # e.g. an unmapped segment: nothing to drop
        return False
    return True


def make_probe(peer_id: str) -> tuple[str, bytes, SegmentWriter]:
    """A one-slab segment holding a random nonce: (name, nonce, writer to close afterwards)."""
    nonce = secrets.token_bytes(NONCE_BYTES)
    w = SegmentWriter(peer_id, slab_bytes=NONCE_BYTES)
    name, _ = w.put(nonce)
    return name, nonce, w


def answer_probe(name: str, sender: str) -> bytes:
    """The receiver's side of the probe: the nonce read from `sender`'s segment `name`."""
    r = SegmentReader(sender)
    try:
        view = r.read(name, 0, NONCE_BYTES)
        nonce = bytes(view)
        view.release()
        return nonce
    finally:
        r.close()
