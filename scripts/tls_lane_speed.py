"""CPU per byte of the ways the bulk lane (peer/bulk.py) could carry TLS, on loopback.

    python scripts/tls_lane_speed.py [--mb 512] [--chunk-mb 1] [--repeat K] [VARIANT ...]

One sender and one receiver process (uvloop, as the benchmark jobs) move `--mb` MiB in
`--chunk-mb` chunks from a numpy buffer into a preallocated one; each reports its own CPU time
(`time.process_time`, all threads). Variants:

  plain      loop.sock_sendall / sock_recv_into on a raw socket (the plaintext bulk lane)
  loop-ssl   a non-blocking ssl.SSLSocket driven by the event loop (add_reader/add_writer):
             SSL_write encrypts straight from the buffer, SSL_read decrypts into it
  thread-ssl a blocking ssl.SSLSocket, each sendall / recv_into in a worker thread
  asyncio-ssl  the event loop's SSL transport (loop.create_connection(ssl=...)): writes copied
             into its buffer, a BufferedProtocol receiver
  bio-ssl    ssl.SSLObject over memory BIOs: SSL_write into memory, one sock_sendall of the
             records; sock_recv_into 256 KiB, then SSL_read from memory into the buffer

TLS: mutual TLS 1.3 with certificates issued like the coordinator issues them (PeerTLS), the
cipher OpenSSL negotiates (printed). Prints one JSON line per run, then the medians per variant.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import uvloop

from shoal.common.certs import PeerTLS, init_certs, load_ca, peer_dns_name
from shoal.coordinator.ca import CertificateAuthority
from shoal.peer.lanes import bulk

VARIANTS = ("plain", "loop-ssl", "thread-ssl", "asyncio-ssl", "bio-ssl")


def _tls(tls_dir: str, name: str) -> PeerTLS:
    ca = CertificateAuthority.from_dir(tls_dir, lifetime_s=3600)
    t = PeerTLS(name)
    issued = ca.issue(name, t.csr())
    t.install(issued.certificate, issued.ca)
    return t


class _Recv(asyncio.BufferedProtocol):
    def __init__(self, buf: memoryview, total: int, done: asyncio.Future):
        self.buf, self.total, self.done, self.got = buf, total, done, 0
        self.c0 = 0.0

    def connection_made(self, transport):
        self.c0 = time.process_time()  # after the handshake

    def get_buffer(self, sizehint):
        off = self.got % self.buf.nbytes
        return self.buf[off:]

    def buffer_updated(self, n):
        self.got += n
        if self.got >= self.total and not self.done.done():
            self.done.set_result(None)

    def connection_lost(self, exc):
        if not self.done.done():
            self.done.set_result(None)


async def _bio_handshake(loop, raw, ctx, server_side, name=None):
    inc, out = ssl.MemoryBIO(), ssl.MemoryBIO()
    obj = ctx.wrap_bio(inc, out, server_side=server_side, server_hostname=name)
    while True:
        try:
            obj.do_handshake()
            break
        except ssl.SSLWantReadError:
            if out.pending:
                await loop.sock_sendall(raw, out.read())
            data = await loop.sock_recv(raw, 65536)
            inc.write(data)
    if out.pending:
        await loop.sock_sendall(raw, out.read())
    return obj, inc, out


async def receiver(variant: str, port_out, tls_dir: str, total: int, chunk: int) -> dict:
    loop = asyncio.get_running_loop()
    buf = memoryview(np.empty(chunk, np.uint8))
    ctx = _tls(tls_dir, "b" * 32).ssl_context(server=True) if variant != "plain" else None
    if variant == "asyncio-ssl":
        done = loop.create_future()
        proto = _Recv(buf, total, done)
        srv = await loop.create_server(lambda: proto, "127.0.0.1", 0, ssl=ctx)
        print(srv.sockets[0].getsockname()[1], file=port_out, flush=True)
        await done
        return {"cpu": time.process_time() - proto.c0, "cipher": ""}
    lst = socket.create_server(("127.0.0.1", 0))
    print(lst.getsockname()[1], file=port_out, flush=True)
    raw, _ = lst.accept()
    c0 = time.process_time()
    if variant == "plain":
        raw.setblocking(False)
        for _ in range(total // chunk):
            await bulk.recv_into(loop, raw, buf)
    elif variant == "loop-ssl":
        raw.setblocking(False)
        s = await bulk.tls_wrap(loop, raw, ctx, server_side=True)
        for _ in range(total // chunk):
            await bulk.recv_into(loop, s, buf)
    elif variant == "bio-ssl":
        raw.setblocking(False)
        s, inc, out = await _bio_handshake(loop, raw, ctx, True)
        c0 = time.process_time()
        scratch = memoryview(bytearray(256 << 10))
        for _ in range(total // chunk):
            got = 0
            while got < chunk:
                try:
                    got += s.read(chunk - got, buf[got:])
                except ssl.SSLWantReadError:
                    k = await loop.sock_recv_into(raw, scratch)
                    inc.write(scratch[:k])
    else:  # thread-ssl
        s = ctx.wrap_socket(raw, server_side=True)
        pool = ThreadPoolExecutor(1)

        def fill():
            got = 0
            while got < chunk:
                got += s.recv_into(buf[got:])

        for _ in range(total // chunk):
            await loop.run_in_executor(pool, fill)
    return {"cpu": time.process_time() - c0, "cipher": s.cipher()[0] if variant != "plain" else ""}


async def sender(variant: str, port: int, tls_dir: str, total: int, chunk: int) -> dict:
    loop = asyncio.get_running_loop()
    src = memoryview(np.random.default_rng(0).integers(0, 255, chunk, dtype=np.uint8))
    ctx = _tls(tls_dir, "a" * 32).ssl_context(server=False) if variant != "plain" else None
    name = peer_dns_name("b" * 32)
    t0, c0 = time.perf_counter(), time.process_time()
    if variant == "asyncio-ssl":
        tr, _ = await loop.create_connection(asyncio.Protocol, "127.0.0.1", port, ssl=ctx, server_hostname=name)
        w = asyncio.StreamWriter(tr, asyncio.StreamReaderProtocol(asyncio.StreamReader()), None, loop)
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(total // chunk):
            tr.write(src)
            while tr.get_write_buffer_size() > 4 * chunk:
                await asyncio.sleep(0.0005)
        while tr.get_write_buffer_size():
            await asyncio.sleep(0.0005)
        tr.close()
        del w
        return {"seconds": time.perf_counter() - t0, "cpu": time.process_time() - c0}
    raw = socket.create_connection(("127.0.0.1", port))
    raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if variant == "plain":
        raw.setblocking(False)
        for _ in range(total // chunk):
            await loop.sock_sendall(raw, src)
        raw.close()
    elif variant == "loop-ssl":
        raw.setblocking(False)
        s = await bulk.tls_wrap(loop, raw, ctx, server_hostname=name)
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(total // chunk):
            await bulk.tls_sendall(loop, s, src)
        s.close()
    else:
        s = ctx.wrap_socket(raw, server_hostname=name)
        pool = ThreadPoolExecutor(1)
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(total // chunk):
            await loop.run_in_executor(pool, s.sendall, src)
        s.close()
    return {"seconds": time.perf_counter() - t0, "cpu": time.process_time() - c0}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=512)
    ap.add_argument("--chunk-mb", type=float, default=1)
    ap.add_argument("--role", choices=["send", "recv"])
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--tls-dir")
    ap.add_argument("--repeat", type=int, default=1, help="runs of every variant (interleaved); medians at the end")
    ap.add_argument("variants", nargs="*", default=list(VARIANTS))
    a = ap.parse_args()
    chunk = int(a.chunk_mb * (1 << 20))
    total = (a.mb << 20) // chunk * chunk
    if a.role == "recv":
        print(json.dumps(uvloop.run(receiver(a.variants[0], sys.stdout, a.tls_dir, total, chunk))), flush=True)
        return
    if a.role == "send":
        print(json.dumps(uvloop.run(sender(a.variants[0], a.port, a.tls_dir, total, chunk))), flush=True)
        return
    with tempfile.TemporaryDirectory() as d:
        init_certs(d)
        assert load_ca(d) is not None
        runs: dict[str, list[dict]] = {}
        for _ in range(a.repeat):  # interleaved, so a change of load hits every variant alike
            for v in a.variants:
                common = ["--mb", str(a.mb), "--chunk-mb", str(a.chunk_mb), "--tls-dir", d, v]
                r = subprocess.Popen([sys.executable, __file__, "--role", "recv", *common], stdout=subprocess.PIPE,
                                     text=True)
                port = int(r.stdout.readline())
                out = subprocess.run([sys.executable, __file__, "--role", "send", "--port", str(port), *common],
                                     capture_output=True, text=True, check=True)
                s = json.loads(out.stdout)
                rv = json.loads(r.stdout.readline())
                r.wait(30)
                gb = total / 1e9
                row = {"variant": v, "cipher": rv.get("cipher", ""), "GB": round(gb, 3),
                       "seconds": round(s["seconds"], 3), "send_cpu_s": round(s["cpu"], 3),
                       "recv_cpu_s": round(rv["cpu"], 3), "send_GB_per_cpu_s": round(gb / s["cpu"], 2),
                       "recv_GB_per_cpu_s": round(gb / max(rv["cpu"], 1e-9), 2)}
                runs.setdefault(v, []).append(row)
                print(json.dumps(row), flush=True)
        for v, rows in runs.items():  # medians over the repeats
            med = {k: float(np.median([r[k] for r in rows])) for k in ("send_GB_per_cpu_s", "recv_GB_per_cpu_s")}
            both = float(np.median([(r["send_cpu_s"] + r["recv_cpu_s"]) / r["GB"] for r in rows]))
            print(json.dumps({"median": v, "repeats": len(rows), **med, "cpu_s_per_GB_both_ends": round(both, 3)}),
                  flush=True)

if __name__ == "__main__":
    main()
