"""The delay line's engine (shoal.testbeds.delayline.DelayLine) and the bed's Latency, driven
directly with synthetic IPv4 packets and a synthetic clock."""

from __future__ import annotations

import socket
import struct

import pytest

from shoal.testbeds.delayline import VNET_HDR, DelayLine, Path, parse_paths, split_tcp_gso, tcp_segments
from shoal.testbeds.netbed import Latency

A, B, C = "10.9.0.1", "10.9.0.2", "10.9.0.3"


def pkt(src: str, dst: str, n: int) -> bytes:
    """A minimal IPv4 header (20 bytes) with the sequence number n in its id field."""
    return struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20, n & 0xFFFF, 0, 64, 6, 0,
                       socket.inet_aton(src), socket.inet_aton(dst))


def ident(p: bytes) -> int:
    return struct.unpack("!H", p[4:6])[0]


def run(line: DelayLine, packets: list[bytes], gap: float = 0.0001) -> list[tuple[float, int]]:
    """Feed packets `gap` seconds apart, then step the clock 0.1 ms at a time until nothing is
    held; returns (release t, id) in release order."""
    out, t = [], 0.0
    for p in packets:
        passed = line.take(p, t)
        if passed is not None:
            out.append((t, ident(passed)))
        out += [(t, ident(q)) for q in line.due(t)]
        t += gap
    while line.held:
        out += [(t, ident(q)) for q in line.due(t)]
        t += 0.0001
    return out


def test_each_direction_is_held_for_its_one_way_delay():
    line = DelayLine({(A, B): Path(delay_ms=50), (B, A): Path(delay_ms=10)})
    out = run(line, [pkt(A, B, 1), pkt(B, A, 2), pkt(A, C, 3)])
    by_id = {i: t for t, i in out}
    assert by_id[3] == pytest.approx(0.0002)  # no path for A→C: passes at once
    assert by_id[1] == pytest.approx(0.050, abs=2e-4)
    assert by_id[2] == pytest.approx(0.0001 + 0.010, abs=2e-4)


def test_jitter_varies_the_delay_but_keeps_the_order():
    line = DelayLine({(A, B): Path(delay_ms=20, jitter_ms=10)}, seed=3)
    out = run(line, [pkt(A, B, i) for i in range(500)])
    assert [i for _, i in out] == list(range(500))
    delays = [t - i * 0.0001 for t, i in out]
    assert min(delays) >= 0.010 - 2e-4 and max(delays) <= 0.030 + 2e-4
    assert max(delays) - min(delays) > 0.010  # it does vary


def test_loss_drops_the_given_fraction_and_the_seed_fixes_which():
    def lost(seed: int) -> list[int]:
        line = DelayLine({(A, B): Path(delay_ms=1, loss=0.1)}, seed=seed)
        got = {i for _, i in run(line, [pkt(A, B, i) for i in range(5000)], gap=0.0)}
        assert line.stats["lost"] == 5000 - len(got)
        return sorted(set(range(5000)) - got)

    first = lost(7)
    assert 400 < len(first) < 600
    assert lost(7) == first
    assert lost(8) != first


def test_loss_is_per_direction():
    line = DelayLine({(A, B): Path(loss=0.5), (B, A): Path()})
    run(line, [pkt(B, A, i) for i in range(1000)], gap=0.0)
    assert line.stats["lost"] == 0


def test_reorder_lets_later_packets_overtake():
    line = DelayLine({(A, B): Path(delay_ms=5, reorder=0.05)}, seed=1)
    order = [i for _, i in run(line, [pkt(A, B, i) for i in range(2000)])]
    assert sorted(order) == list(range(2000))
    assert order != list(range(2000))
    assert 50 < line.stats["reordered"] < 150


def test_a_new_table_keeps_the_release_times_of_held_packets():
    line = DelayLine({(A, B): Path(delay_ms=100)})
    assert line.take(pkt(A, B, 1), 0.0) is None
    line.set_paths({})
    assert line.take(pkt(A, B, 2), 0.001) is not None  # new packets pass at once
    assert line.due(0.05) == []
    assert [ident(p) for p in line.due(0.1)] == [1]


def test_non_ipv4_passes():
    line = DelayLine({(A, B): Path(delay_ms=100)})
    assert line.take(b"\x60" + b"\x00" * 39, 0.0) is not None
    assert line.stats["not_ipv4"] == 1


@pytest.mark.parametrize("kw, field", [({"delay_ms": -1}, "delay_ms"), ({"loss": 1.0}, "loss"),
                                       ({"delay_ms": 5, "jitter_ms": 6}, "jitter_ms"),
                                       ({"reorder": float("nan")}, "reorder")])
def test_path_refuses_values_outside_their_range(kw, field):
    with pytest.raises(ValueError, match=field):
        Path(**kw)


def test_parse_paths_names_the_bad_row():
    assert parse_paths([[A, B, 10, 1, 0.01, 0]]) == {(A, B): Path(10, 1, 0.01, 0)}
    with pytest.raises(ValueError, match=r"paths\[1\]"):
        parse_paths([[A, B, 10, 1, 0.01, 0], [A, "nowhere", 1, 0, 0, 0]])
    with pytest.raises(ValueError, match=r"paths\[0\].*loss"):
        parse_paths([[A, B, 10, 1, 2, 0]])


def test_latency_splits_the_rtt_and_combines_by_the_larger():
    assert Latency(rtt_ms=100, jitter_ms=5, loss=0.001).one_way() == Path(50, 5, 0.001, 0)
    assert Latency.combine(Latency(100, loss=0.01), Latency(30, loss=0.02)) == Latency(100, 0, 0.02, 0)
    assert Latency.combine(None, Latency(30)) == Latency(30)
    assert Latency.combine(None, None) is None
    with pytest.raises(ValueError, match="jitter_ms"):
        Latency(rtt_ms=10, jitter_ms=6)


# --- frames with a virtio-net header (the device's segmentation offload) -------------------------

MSS = 1448


def _csum(b: bytes) -> int:
    if len(b) % 2:
        b += b"\0"
    total = sum(struct.unpack(f"!{len(b) // 2}H", b))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return total


def gso_frame(src: str, dst: str, payload: bytes, seq: int = 1000, flags: int = 0x18 | 0x80 | 0x01,
              ident_: int = 7) -> bytes:
    """A virtio-net header + an IPv4/TCP super-packet (20-byte IP header, 32-byte TCP header with
    a timestamp option) carrying `payload` in segments of MSS bytes, checksum left partial."""
    tcp = struct.pack("!HHIIBBHHH", 40000, 5301, seq, 1, 8 << 4, flags, 512, 0, 0) + b"\x01\x01\x08\x0a" + b"\0" * 8
    ip = bytearray(struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(tcp) + len(payload), ident_, 0x4000, 64, 6, 0,
                               socket.inet_aton(src), socket.inet_aton(dst)))
    struct.pack_into("!H", ip, 10, 0xFFFF - _csum(bytes(ip)))
    pseudo = _csum(ip[12:20] + struct.pack("!HH", 6, len(tcp) + len(payload)))
    tcp = tcp[:16] + struct.pack("!H", pseudo) + tcp[18:]
    hdr = VNET_HDR.pack(1, 1, 52, MSS, 20, 16)
    return hdr + bytes(ip) + tcp + payload


def check_piece(frame: bytes) -> tuple[int, int, int, bytes]:
    """Assert one written frame is well formed; returns (seq, ip id, tcp flags, payload)."""
    flags, gso_type, hdr_len, gso_size, cstart, coff = VNET_HDR.unpack_from(frame)
    pkt = frame[VNET_HDR.size:]
    assert flags == 1 and (cstart, coff) == (20, 16)
    assert _csum(pkt[:20]) == 0xFFFF  # a valid IP header checksum
    total = struct.unpack_from("!H", pkt, 2)[0]
    assert total == len(pkt)
    body = pkt[52:]
    assert (gso_type, gso_size, hdr_len) == ((1, MSS, 52) if len(body) > MSS else (0, 0, 0))
    # completing the partial checksum as the kernel does gives the from-scratch TCP checksum
    tcp = bytearray(pkt[20:])
    done = 0xFFFF - _csum(bytes(tcp))
    struct.pack_into("!H", tcp, 16, 0)
    scratch = 0xFFFF - _csum(pkt[12:20] + struct.pack("!HH", 6, len(tcp)) + bytes(tcp))
    assert done == scratch
    return struct.unpack_from("!I", pkt, 24)[0], struct.unpack_from("!H", pkt, 4)[0], pkt[33], body


def test_split_keeps_every_segment_but_the_lost_ones_with_their_numbers():
    payload = bytes(range(256)) * 40 + b"tail"  # 10,244 bytes: 8 segments, the last short
    frame = gso_frame(A, B, payload)
    assert tcp_segments(frame[VNET_HDR.size:], MSS) == 8
    pieces = split_tcp_gso(frame[VNET_HDR.size:], MSS, False, [(0, 2), (3, 4), (5, 8)])
    got = [check_piece(p) for p in pieces]
    assert [s for s, _, _, _ in got] == [1000, 1000 + 3 * MSS, 1000 + 5 * MSS]
    assert [i for _, i, _, _ in got] == [7, 10, 12]
    assert [b for _, _, _, b in got] == [payload[:2 * MSS], payload[3 * MSS:4 * MSS], payload[5 * MSS:]]
    assert [f for _, _, f, _ in got] == [0x90, 0x10, 0x19]  # CWR on the first, FIN/PSH on the last


def test_a_super_packet_meets_the_loss_once_per_segment():
    line = DelayLine({(A, B): Path(delay_ms=1, loss=0.01)}, seed=5, vnet=True)
    payload = b"x" * (40 * MSS)
    kept = 0
    for k in range(500):
        assert line.take(gso_frame(A, B, payload, seq=k * len(payload)), k * 1e-4) is None
        for p in line.due(k * 1e-4 + 0.002):
            kept += len(check_piece(p)[3])
    assert line.stats["segments_in"] == 500 * 40
    assert 120 < line.stats["lost"] < 280  # 1 % of 20,000 segments
    assert kept == (20_000 - line.stats["lost"]) * MSS
    assert 0 < line.stats["split"] <= line.stats["lost"]


def test_frames_without_a_path_or_not_tcp_pass_unchanged():
    line = DelayLine({(A, B): Path(delay_ms=10, loss=0.5)}, vnet=True)
    f = gso_frame(A, C, b"y" * 5000)
    assert line.take(f, 0.0) == f
    udp = VNET_HDR.pack(0, 0, 0, 0, 0, 0) + pkt(B, A, 3)
    assert line.take(udp, 0.0) == udp
