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

Fewer copies and bounded memory (docs/performance.md, "Lanes"): a
collective's result buffer can itself be a segment of its sender (`create_segment`, pooled by
`peer.dataplane.Transport.take_result`), so chunks sent from it need no slab at all; a writer
going back to its pool keeps only the slabs its last use wrote (`SegmentWriter.trim`); and a
receiver drops its mapping of a chunk's pages once consumed (`release`), so shared pages are
counted in the sender's resident size only.

Raises (receiver side) `InvalidArgument` naming the field (`shm_name`, `shm_offset`) for a name,
size or range that does not fit; the caller turns it into INVALID_ARGUMENT.
"""

from __future__ import annotations

import logging
import mmap
import os
import re
import secrets
import stat

import numpy as np

from shoal.common.errors import InvalidArgument, require
from shoal.peer.lanes.base import CollectiveError
from shoal.peer.pooled import Pooled, anonymous, take_pooled

log = logging.getLogger("shoal.peer.lanes.shm")

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


# The sender's side of the lane: where a collective's chunks are placed for co-located receivers.

SHARED_POOL = ""  # Transport.take_writer: the writers whose slabs every co-located receiver reads
# Shared-memory reduce-scatter chunks whose consumption the receiver signals (`Laps`): the bytes
# of one lap (or one chunk, if larger); a stream's slabs hold at most two laps, whatever the
# tensor and chunk size. In bytes, not chunks, so that a lap writer fits every chunk size: the
# warm-up round (1 MiB chunks, lanes not yet reported) leaves the slabs that the next rounds
# (4 MiB chunks on the lane) reuse, instead of each new chunk size growing new ones.
LAP_BYTES = 16 << 20


class Laps:
    """A stream's shared-memory chunks whose consumption the collective can await (`credit(key)`
    returns once the receiver consumed chunk `key`), written in two alternating laps of at most
    `lap_bytes` bytes each (at least one chunk), each lap in its own writer (from `take()`, one
    slab of `lap_bytes`): a lap's slab is rewritten (rewound) only once every chunk written
    there in its previous turn was consumed, so the slabs hold at most 2 x `lap_bytes` however
    large the tensor, and a receiver never reads a rewritten chunk. `credit` raises what the
    collective raises for a receiver that never consumes (CollectiveError at the chunk
    deadline)."""

    def __init__(self, take, credit, lap_bytes: int = LAP_BYTES):
        self.take, self.credit, self.lap_bytes = take, credit, lap_bytes
        self.writers: list[SegmentWriter] = []
        self.keys: tuple[list, list] = ([], [])  # per lap: the chunks written in its current turn
        self.used = [0, 0]  # per lap: bytes written in its current turn
        self.lap = 0
        self.closed = False  # the stream ended: its writers went back or were closed

    async def put(self, key, body) -> tuple[str, int]:
        """Write `body` (chunk `key`) into the current lap; (segment name, offset)."""
        n = memoryview(body).nbytes
        if self.keys[self.lap] and self.used[self.lap] + n > self.lap_bytes:
            self.lap ^= 1
            for k in self.keys[self.lap]:  # the other lap's last turn: consumed before it is rewritten
                await self.credit(k)
            self.keys[self.lap].clear()
            self.used[self.lap] = 0
            if self.lap < len(self.writers):
                self.writers[self.lap].rewind()
        if self.closed:
            raise CollectiveError("stream closed while a chunk waited for room")
        if self.lap == len(self.writers):
            self.writers.append(self.take())
        self.keys[self.lap].append(key)
        self.used[self.lap] += n
        return self.writers[self.lap].put(body)


def lap_bytes(chunk_bytes: int, tensor_bytes: int, participants: int) -> int:
    """A lap's bytes for reduce-scatter chunks of at most `chunk_bytes` of a tensor of
    `tensor_bytes` shared by `participants`: the power of two that holds an even shard, at most
    `LAP_BYTES`, at least one chunk. Not from this round's shards: the planner moves shard
    bounds and owners from one round to the next, and a lap size that followed them would make
    new slabs (fresh pages) in rounds that differ only in a shard bound; nor from the chunk size
    alone, which changes once the lanes are known (the warm-up round's chunks are smaller)."""
    even = -(-tensor_bytes // max(1, participants))
    return max(chunk_bytes, min(LAP_BYTES, 1 << max(0, even - 1).bit_length()))


class StreamSlabs:
    """Where one stream's chunks are for its co-located receiver: pointed at where they already
    are (`placed`: a shared result buffer, an owner's `SharedSlabs`), written into the stream's
    `Laps` (reduce-scatter chunks of a bounded butterfly), or copied once into a writer reused
    across streams (`take(slab_bytes)`, from the transport's pool). `end()` hands back the
    writers (to give back after a completed stream, or to close after a failed one); a chunk
    placed after the end raises CollectiveError blaming the receiver."""

    def __init__(self, take, peer_id: str):
        self.take, self.peer_id = take, peer_id
        self.open = True
        self.writer: SegmentWriter | None = None  # taken at its first chunk: bounded streams may need none
        self.laps: Laps | None = None

    def bound(self, credit, lap_bytes: int) -> None:
        self.laps = Laps(lambda: self.take(lap_bytes), credit, lap_bytes)

    async def place(self, msg, body, placed, reduce_scatter: bool) -> None:
        """Set `msg.shm_name`/`shm_offset` to where `body` is for the receiver. Raises OSError
        when a segment cannot be written (/dev/shm full)."""
        if not self.open:
            raise CollectiveError(f"stream to {self.peer_id[:8]} closed", [self.peer_id])
        if placed is not None:
            msg.shm_name, msg.shm_offset = placed()
        elif self.laps is not None and reduce_scatter:
            msg.shm_name, msg.shm_offset = await self.laps.put((msg.shard, msg.offset), body)
        else:
            if self.writer is None:
                self.writer = self.take(0)
            msg.shm_name, msg.shm_offset = self.writer.put(body)

    def end(self) -> list[SegmentWriter]:
        """End the stream's shared-memory side: its writers, to give back or close."""
        out = [self.writer] if self.writer is not None else []
        if self.laps is not None:
            self.laps.closed = True
            out += self.laps.writers
        self.open, self.writer, self.laps = False, None, None
        return out


class SharedSlabs:
    """A shard owner's reduced chunks for its co-located receivers, written once into one
    writer's slabs that all of them read: one copy per chunk instead of one per receiver, and
    1/p of the tensor in slabs instead of (p-1)/p. The writer comes from the transport's shared
    pool (`take_writer(SHARED_POOL)`, its pages already touched) at the first chunk placed, and
    goes back by `finish(True)` only once every stream of the attempt completed (each receiver
    took every chunk, and reads them before its next vote); after a failure it is closed, never
    rewritten."""

    def __init__(self, transport):
        self.transport = transport
        self.writer: SegmentWriter | None = None
        self._placed: dict[tuple[int, int], tuple[str, int]] = {}

    def placement(self, key: tuple[int, int], body):
        """A callable placing `body` (chunk `key` = (shard, offset)) once; (segment, offset)."""
        def place() -> tuple[str, int]:
            if key not in self._placed:
                if self.writer is None:
                    self.writer = self.transport.take_writer(SHARED_POOL)
                self._placed[key] = self.writer.put(body)
            return self._placed[key]
        return place

    def finish(self, ok: bool) -> None:
        if self.writer is not None:
            if ok:
                self.transport.give_back_writer(SHARED_POOL, self.writer)
            else:
                self.writer.close()
            self.writer = None


class ResultBuffer:
    """One attempt's result buffer `values` `(n,)` of x's dtype: in a shared-memory segment of
    this peer (`Transport.take_result`, reused once the array on it is gone) when the transport
    already reaches a participant through shared memory, so that chunks sent from it (an owner's
    aggregates, the ring's partial sums and relayed final chunks) need neither a slab nor a copy:
    `placement` says where they are. Else (no co-located participant, lanes not chosen yet,
    /dev/shm full, a tensor larger than a receiver maps) this process's memory
    (`Transport.take_buffer`). Receivers read it until they voted, and the segment is rewritten
    only once the array is gone, so in a later collective (as slabs are)."""

    def __init__(self, x: np.ndarray, addresses, transport):
        self.name = ""
        lanes = transport.lanes()
        if (transport.shared_memory and 0 < x.nbytes <= MAX_SEGMENT_BYTES
                and any(lanes.get(a) == "shm" for a in addresses)):
            try:
                self.name, self.values = transport.take_result(x.size, x.dtype)
            except OSError as exc:  # /dev/shm full: this process's memory, the chunks through slabs
                log.info("result buffer in this process's memory: %s", exc)
        if not self.name:
            take = getattr(transport, "take_buffer", None)
            self.values = take(x.size, x.dtype) if take is not None else np.empty_like(x)

    @property
    def private(self) -> bool:
        """Whether the buffer is in this process's memory, not a shared segment co-located
        receivers read. (It may be reused by a later collective too, `Transport.take_buffer`, but
        only once no array on it is alive: a bulk lane still reading into a place the inbox
        handed out holds a view of it.)"""
        return not self.name

    def placement(self, span, payload):
        """A callable giving (segment, byte offset) of `payload` when it is this buffer's own
        slice of `span` (so the shared-memory lane can point at it); None otherwise."""
        if not self.name or not isinstance(payload, np.ndarray) or payload.size != span.size:
            return None
        lo = span.lo * self.values.itemsize
        if payload.__array_interface__["data"][0] != self.values.__array_interface__["data"][0] + lo:
            return None
        return lambda: (self.name, lo)


class WriterPool:
    """Idle `SegmentWriter`s per receiving address (`SHARED_POOL`: the writers whose slabs every
    co-located receiver reads), their slabs already touched, so that the next stream rewrites
    pages instead of faulting fresh ones."""

    def __init__(self, peer_id: str):
        self.peer_id = peer_id
        self.idle: dict[str, list[SegmentWriter]] = {}

    def take(self, address: str, slab_bytes: int = 0) -> SegmentWriter:
        """An idle writer towards `address`, or a new one: with `slab_bytes`, one whose slabs have
        that size (a reduce-scatter lap's writer, `Laps`: one slab holds a lap), else one whose
        slabs grow."""
        pool = self.idle.get(address)
        i = next((i for i in range(len(pool or ()) - 1, -1, -1) if pool[i].fixed == slab_bytes), None)
        if i is not None:
            w = pool.pop(i)
        elif slab_bytes:
            w = SegmentWriter(self.peer_id, slab_bytes=slab_bytes, first_slab_bytes=slab_bytes)
        else:
            w = SegmentWriter(self.peer_id)
        w.rewind()
        return w

    def give_back(self, address: str, writer: SegmentWriter, keep: bool) -> None:
        """Keep `writer` for `address` (trimmed to the slabs its last use wrote), or close it.
        Idle lap writers of another size towards `address` are closed (the laps changed: a new
        chunk or shard size), so that an address keeps the writers of one lap size only."""
        if not keep:
            writer.close()
            return
        writer.trim()
        pool = self.idle.setdefault(address, [])
        if writer.fixed:
            for w in [w for w in pool if w.fixed and w.fixed != writer.fixed]:
                pool.remove(w)
                w.close()
        pool.append(writer)

    def forget(self, address: str) -> None:
        for w in self.idle.pop(address, []):
            w.close()

    def close(self) -> None:
        for pool in self.idle.values():
            for w in pool:
                w.close()
        self.idle.clear()


class ResultPool:
    """Result buffers of the collectives, reused once no array on them is alive any more (the
    last one and every view of it gone: a committed state that was replaced, a failed attempt's
    buffer): segments of this peer that co-located receivers read (`take_result`, at most
    `idle_segments` idle ones kept, the others unlinked), and buffers in this process's memory
    (`take_buffer`, at most `idle_buffers`)."""

    def __init__(self, peer_id: str, idle_segments: int, idle_buffers: int):
        self.peer_id, self.idle_segments, self.idle_buffers = peer_id, idle_segments, idle_buffers
        self.segments: list[Pooled] = []  # result segments (shared memory, named)
        self.buffers: list[Pooled] = []  # result buffers in this process's memory

    def take_result(self, n: int, dtype) -> tuple[str, np.ndarray]:
        def segment(nbytes: int) -> Pooled:
            name, mm = create_segment(self.peer_id, nbytes)
            return Pooled(mm, name)

        entry, arr = take_pooled(self.segments, n, dtype, self.idle_segments, segment, self._drop)
        return entry.name, arr

    def take_buffer(self, n: int, dtype) -> np.ndarray:
        # A dropped buffer is unmapped by the garbage collector once nothing refers to it.
        return take_pooled(self.buffers, n, dtype, self.idle_buffers, anonymous, self.buffers.remove)[1]

    def _drop(self, entry: Pooled) -> None:
        self.segments.remove(entry)
        unlink(entry.name)
        try:
            entry.mm.close()
        except BufferError:  # an array on it is still alive: unmapped when it goes
            pass

    def close(self) -> None:
        for e in list(self.segments):
            self._drop(e)
