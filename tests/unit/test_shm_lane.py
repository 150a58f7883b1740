"""The shared-memory lane (peer/lanes/shm.py): segments, checks, and all-reduces that use it.

Segments are real files in /dev/shm; the all-reduces run over real gRPC streams on loopback in
this event loop, with real Ed25519 identities and coordinator-signed tickets.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from shoal.peer.lanes import shm
from shoal.peer.dataplane import Session
from shoal.common.errors import InvalidArgument
from shoal.v1 import shoal_pb2 as pb

pytestmark = pytest.mark.skipif(not shm.available(), reason="no writable /dev/shm on this machine")

# Per test process (the slab names' 16-hex prefix): parallel test workers share /dev/shm.
ALICE = f"{os.getpid():08x}" + "a1" * 12
BOB = f"{os.getpid():08x}" + "b2" * 12


def _mine(peer_id: str) -> set[str]:
    return {n for n in os.listdir(shm.SHM_DIR) if n.startswith(f"shoal-{peer_id[:16]}-")}


def test_writer_reader_roundtrip_and_reuse():
    w = shm.SegmentWriter(ALICE, slab_bytes=4096)
    try:
        a = np.arange(300, dtype=np.float32)  # 1200 bytes
        n1, o1 = w.put(a)
        n2, o2 = w.put(a[::-1].copy())
        n3, o3 = w.put(np.zeros(1000, dtype=np.float32))  # 4000 bytes: a second slab
        assert (n1, o1, n2, o2) == (n1, 0, n1, 1200) and n3 != n1 and o3 == 0
        r = shm.SegmentReader(ALICE)
        assert np.array_equal(np.frombuffer(r.read(n1, 0, 1200), np.float32), a)
        view = np.frombuffer(r.read(n2, 1200, 1200), np.float32)
        assert np.array_equal(view, a[::-1]) and not view.flags.writeable
        w.rewind()  # the next stream reuses the slabs: same names, no new files
        assert w.put(a) == (n1, 0)
        assert _mine(ALICE) == {n1, n3}
        del view
        r.close()
    finally:
        w.close()
    assert _mine(ALICE) == set()


@pytest.mark.parametrize("name, offset, n, field", [
    ("../etc/passwd", 0, 4, "shm_name"),
    ("shoal-zz-zz", 0, 4, "shm_name"),
    (None, 0, 1 << 20, "shm_offset"),  # past the end of the segment
    ("other", 0, 4, "shm_name"),  # a well-formed name of another peer
    ("gone", 0, 4, "shm_name"),  # a name that does not exist
])
def test_reader_refuses_bad_names_and_ranges(name, offset, n, field):
    w = shm.SegmentWriter(ALICE, slab_bytes=4096)
    try:
        real, _ = w.put(np.zeros(8, np.float32))
        name = {None: real, "other": f"shoal-{BOB[:16]}-{'0' * 16}",
                "gone": f"shoal-{ALICE[:16]}-{'f' * 16}"}.get(name, name)
        with pytest.raises(InvalidArgument, match=field):
            shm.SegmentReader(ALICE).read(name, offset, n)
    finally:
        w.close()


def test_remove_stale_deletes_only_this_identity():
    wa, wb = shm.SegmentWriter(ALICE, 4096), shm.SegmentWriter(BOB, 4096)
    try:
        wa.put(b"x" * 10)
        wb.put(b"y" * 10)
        assert shm.remove_stale(ALICE) == 1
        assert _mine(ALICE) == set() and len(_mine(BOB)) == 1
    finally:
        wa.close()
        wb.close()


def test_remove_stale_of_keys_finds_keys_in_data_directories_only_when_recursive(tmp_path):
    """A peer started without --key keeps its key in its data directory (data/shoal/peer-1.key):
    a launcher that killed it cleans its slabs only when it looks below its workdir. Regression:
    test_members_processes' two peers from one directory left a result segment each in /dev/shm."""
    from shoal.common.identity import load_or_create_key, peer_id_of, public_bytes

    key = tmp_path / "data" / "shoal" / "peer-1.key"
    key.parent.mkdir(parents=True)
    me = peer_id_of(public_bytes(load_or_create_key(key)))
    w = shm.SegmentWriter(me, 4096)
    try:
        w.put(b"x" * 10)
        assert shm.remove_stale_of_keys(tmp_path) == 0 and len(_mine(me)) == 1
        assert shm.remove_stale_of_keys(tmp_path, recursive=True) == 1 and _mine(me) == set()
    finally:
        w.close()


def test_check_chunk_reads_shared_memory_only_with_a_reader():
    w = shm.SegmentWriter(ALICE, 4096)
    try:
        name, off = w.put(np.arange(16, dtype=np.float32))
        s = Session(0, 0, frozenset({ALICE}), pb.FLOAT32, None, (0, 16), 16)
        c = pb.Chunk(round=0, attempt=0, sender=ALICE, phase=pb.REDUCE_SCATTER, shard=0, offset=0, dtype=pb.FLOAT32,
                     shape=[16], shm_name=name, shm_offset=off)
        assert np.array_equal(s.check_chunk(c, shm.SegmentReader(ALICE)), np.arange(16, dtype=np.float32))
        with pytest.raises(InvalidArgument, match="shm_name"):
            s.check_chunk(c, None)  # this receiver does not take the lane
        c.data = b"\0" * 64
        with pytest.raises(InvalidArgument, match="data"):
            s.check_chunk(c, shm.SegmentReader(ALICE))  # both inline bytes and a segment
    finally:
        w.close()


def test_a_fifo_under_a_valid_name_is_refused_without_blocking():
    import threading

    name = f"shoal-{ALICE[:16]}-{'e' * 16}"
    path = os.path.join(shm.SHM_DIR, name)
    os.mkfifo(path, 0o600)
    outcome: list[BaseException | None] = []

    def read() -> None:
        try:
            shm.SegmentReader(ALICE).read(name, 0, 4)
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - recorded for the assertion
            outcome.append(exc)

    t = threading.Thread(target=read, daemon=True)
    try:
        t.start()
        t.join(5)
        if t.is_alive():  # release the blocked open before failing
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
            t.join(5)
            pytest.fail("opening a FIFO named like a segment blocked")
        assert isinstance(outcome[0], InvalidArgument) and "shm_name" in str(outcome[0])
    finally:
        os.unlink(path)


def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def test_a_result_segment_is_mapped_at_creation_and_zero_a_slab_is_not():
    import platform

    if tuple(int(x) for x in platform.release().split(".")[:2] if x.isdigit()) < (5, 14):
        pytest.skip("MADV_POPULATE_WRITE needs Linux >= 5.14")
    before = _rss()
    name, mm = shm.create_segment(ALICE, 8 << 20)
    try:
        assert _rss() - before > 6 << 20  # its pages are this process's now, before any write
        assert mm[:16] == bytes(16) and mm[-16:] == bytes(16)
    finally:
        mm.close()
        shm.unlink(name)
    lap = shm.SegmentWriter(ALICE, slab_bytes=8 << 20, first_slab_bytes=8 << 20)
    try:
        before = _rss()
        lap.put(np.zeros(1000, dtype=np.float32))  # a slab (possibly filled in part): only what is written
        assert _rss() - before < 1 << 20
    finally:
        lap.close()


def test_release_drops_only_the_readers_pages_and_keeps_the_bytes():
    w = shm.SegmentWriter(ALICE)
    r = shm.SegmentReader(ALICE)
    try:
        data = np.arange(4 << 20, dtype=np.float32)  # 16 MiB, written by the sender (its memory)
        name, off = w.put(data)
        view = np.frombuffer(r.read(name, off, data.nbytes), np.float32)
        assert int(view[::1024].sum()) == int(data[::1024].sum())  # the reader's pages mapped now
        before = _rss()
        assert shm.release(view)
        assert before - _rss() > data.nbytes // 2  # the reader's share of the slab left its RSS
        assert view.tobytes() == data.tobytes()  # and the bytes are the sender's, unchanged
        own = data.copy()
        assert not shm.release(own) and not shm.release(data[:10]) and own.tobytes() == data.tobytes()
        del view
    finally:
        r.close()
        w.close()


async def test_laps_rewrite_a_slab_region_only_after_its_chunk_was_consumed():
    from shoal.peer.lanes.shm import Laps

    per_lap = 4  # chunks of 4000 bytes in a lap of 16000
    consumed: set[int] = set()
    credited: list[int] = []
    holder: dict[tuple[str, int], int] = {}  # slab region -> the chunk it holds now

    async def credit(key):
        credited.append(key)
        consumed.add(key)

    writers = []

    def take():
        writers.append(shm.SegmentWriter(ALICE, slab_bytes=per_lap * 4000, first_slab_bytes=per_lap * 4000))
        return writers[-1]

    laps = Laps(take, credit, per_lap * 4000)
    try:
        chunk = np.zeros(1000, dtype=np.float32)
        for i in range(5 * per_lap + 1):
            place = await laps.put(i, chunk + i)
            old = holder.get(place)
            assert old is None or old in consumed, f"chunk {i} overwrote chunk {old} before it was consumed"
            holder[place] = i
            # chunk i waits only for chunks two laps back, never for one still in flight
            assert all(k <= i - per_lap - 1 for k in credited)
        assert len(writers) == 2 and len(holder) == 2 * per_lap  # memory: two laps, reused
        assert all(len(w._slabs) == 1 for w in writers)  # a lap fills one slab
        assert credited == list(range(4 * per_lap))
        # a smaller last chunk still fits its lap; a chunk larger than a lap is a lap of its own
        await laps.put("small", np.zeros(10, dtype=np.float32))
        big = await laps.put("big", np.zeros(5000, dtype=np.float32))
        assert big[1] == 0 and laps.keys[laps.lap] == ["big"]
    finally:
        for w in writers:
            w.close()


def test_lap_bytes_follow_the_tensor_not_its_shards_and_hold_at_least_one_chunk():
    from shoal.peer.lanes.shm import LAP_BYTES, lap_bytes

    assert lap_bytes(4 << 20, 64_000_000, 4) == LAP_BYTES == 16 << 20  # shards of 16 MB: one lap each
    assert lap_bytes(1 << 20, 64_000_000, 4) == lap_bytes(4 << 20, 64_000_000, 4)  # warm-up and later chunks
    assert lap_bytes(4 << 20, 500_000_000, 3) == LAP_BYTES
    assert lap_bytes(1 << 20, 20_000_000, 4) == 8 << 20  # shards of 5 MB: no 16 MiB slab for them
    assert lap_bytes(64 << 10, 100_000, 2) == 64 << 10  # at least one chunk
    assert lap_bytes(32 << 20, 500_000_000, 3) == 32 << 20


async def test_lap_writers_are_pooled_by_size_and_other_sizes_closed():
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from shoal.peer.dataplane import Transport

    t = Transport(key=Ed25519PrivateKey.generate(), shared_memory=True)
    addr = "127.0.0.1:1"
    t._lanes[addr] = None  # as if probed: writers towards it are pooled
    try:
        grow, lap = t.take_writer(addr), t.take_writer(addr, 1 << 16)
        assert grow.fixed == 0 and lap.fixed == 1 << 16
        lap.put(np.zeros(1000, dtype=np.float32))
        name = lap._slabs[0][0]
        t.give_back_writer(addr, grow)
        t.give_back_writer(addr, lap)
        again = t.take_writer(addr, 1 << 16)
        assert again is lap and again._slabs[0][0] == name  # the same slab: its pages already touched
        assert t.take_writer(addr) is grow
        t.give_back_writer(addr, grow)
        bigger = t.take_writer(addr, 1 << 17)
        bigger.put(np.zeros(1000, dtype=np.float32))
        t.give_back_writer(addr, again)
        t.give_back_writer(addr, bigger)  # the laps changed: the old size goes
        assert not again._slabs and not os.path.exists(os.path.join(shm.SHM_DIR, name))
        assert [w.fixed for w in t._writers[addr]] == [0, 1 << 17]
    finally:
        t._lanes.clear()
        await t.close()


async def test_result_segments_are_reused_only_once_their_arrays_are_gone():
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from shoal.peer.dataplane import IDLE_RESULT_SEGMENTS, Transport

    t = Transport(key=Ed25519PrivateKey.generate(), shared_memory=True)
    try:
        a_name, a = t.take_result(1000, np.float32)
        a[:] = 1
        view = a[10:20]  # a committed state may be held through a view
        del a
        b_name, b = t.take_result(1000, np.float32)
        assert b_name != a_name  # a's segment is still in use through the view
        del view
        c_name, c = t.take_result(1000, np.float32)
        assert c_name == a_name and c.flags.writeable  # a's memory is free now: reused
        del b, c
        names = {t.take_result(1000, np.float32)[0] for _ in range(3)}
        assert len(names) == 1  # each array dropped at once: one segment serves all
        held = [t.take_result(10, np.float32) for _ in range(4)]  # another size: new segments
        del held
        t.take_result(20, np.float32)
        idle = [e for e in t._results if e.ref() is None]
        assert len(idle) <= IDLE_RESULT_SEGMENTS  # the others were unlinked
        assert len(_mine(t.peer_id)) == len(t._results)
    finally:
        await t.close()
    assert not _mine(t.peer_id)


def test_trim_keeps_the_slabs_of_the_last_use_only():
    w = shm.SegmentWriter(ALICE, slab_bytes=4096, first_slab_bytes=4096)
    try:
        for _ in range(3):
            w.put(np.zeros(1000, dtype=np.float32))  # one slab each
        assert len(_mine(ALICE)) == 3
        w.trim()  # all three were written since the writer was taken
        assert len(_mine(ALICE)) == 3
        w.put(np.zeros(1000, dtype=np.float32))
        w.trim()  # the last use needed one slab: the two others go
        assert len(_mine(ALICE)) == 1
        w.trim()  # unused since: nothing kept
        assert len(_mine(ALICE)) == 0
    finally:
        w.close()
