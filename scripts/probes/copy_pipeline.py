"""Probe: how fast can a host-copy handoff be, outside Dask? The numbers the pinned pipelined copy path needs.

The host-copy path (workers on different hosts) should beat Dask TCP with CuPy arrays of 256 MiB and more (Dask
TCP: 849 ms per GiB on one H200, 2026-11-22). Dask's comm
serializes a whole message and writes it from one thread, so overlapping the device->host copy with the
send needs a transport of its own. Before building it, this probe measures, in one process:

1. socket throughput on this host: TCP loopback and a Unix socketpair, one stream and ``STREAMS`` streams;
2. with a GPU: device->host and host->device copies of ``SIZE`` bytes into pageable and into pinned memory;
3. with a GPU: the whole pipeline over TCP loopback. A sender thread copies chunk n+1 device->host into
   pinned staging while it sends chunk n. A receiver thread receives into pinned staging and copies each
   chunk host->device while the next one arrives. ``SLOTS`` staging chunks of ``CHUNK`` bytes on each side.

Run: ``python3 scripts/probes/copy_pipeline.py`` (PROBE_SIZE, PROBE_CHUNK, PROBE_SLOTS, PROBE_STREAMS).
Prints one line per measurement in GB/s and ms; without a GPU only part 1 runs.
"""

from __future__ import annotations

import ctypes
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

SIZE = int(os.environ.get("PROBE_SIZE", 1 << 30))
CHUNK = int(os.environ.get("PROBE_CHUNK", 16 << 20))
SLOTS = int(os.environ.get("PROBE_SLOTS", 3))
STREAMS = int(os.environ.get("PROBE_STREAMS", 4))


def report(what: str, nbytes: int, seconds: float) -> None:
    print(f"{what:58s} {nbytes / seconds / 1e9:7.2f} GB/s  {seconds * 1e3:9.1f} ms", flush=True)


def view(ptr: int, n: int) -> memoryview:
    """A writable memoryview of ``n`` bytes at address ``ptr`` (pinned host memory)."""
    return memoryview((ctypes.c_char * n).from_address(ptr)).cast("B")


def tcp_pair() -> tuple[socket.socket, socket.socket]:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    a = socket.create_connection(srv.getsockname())
    b, _ = srv.accept()
    srv.close()
    for s in (a, b):
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return a, b


def recv_exactly(sock: socket.socket, mv: memoryview) -> None:
    got = 0
    while got < len(mv):
        n = sock.recv_into(mv[got:])
        if n == 0:
            raise ConnectionError("peer closed")
        got += n


def stream_bytes(pairs: list[tuple[socket.socket, socket.socket]], total: int) -> float:
    """Seconds to move ``total`` bytes split over the socket pairs (one sender and one receiver thread each)."""
    per = total // len(pairs)
    src = bytearray(CHUNK)
    dst = [bytearray(CHUNK) for _ in pairs]

    def send(s: socket.socket) -> None:
        left = per
        while left:
            n = min(CHUNK, left)
            s.sendall(memoryview(src)[:n])
            left -= n

    def recv(s: socket.socket, buf: bytearray) -> None:
        left = per
        while left:
            n = min(CHUNK, left)
            recv_exactly(s, memoryview(buf)[:n])
            left -= n

    threads = [threading.Thread(target=send, args=(a,)) for a, _ in pairs]
    threads += [threading.Thread(target=recv, args=(b, d)) for (_, b), d in zip(pairs, dst, strict=True)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


def sockets() -> None:
    for name, make in (("tcp loopback", tcp_pair), ("unix socketpair", socket.socketpair)):
        for k in (1, STREAMS):
            pairs = [make() for _ in range(k)]
            report(f"{name}, {k} stream(s), {CHUNK >> 20} MiB sends", SIZE, stream_bytes(pairs, SIZE))
            for a, b in pairs:
                a.close()
                b.close()


def copies(dev: Any) -> None:
    import numpy as np
    from cuda.bindings import driver
    from cuda.core import DeviceMemoryResource, PinnedMemoryResource

    stream = dev.create_stream()
    dbuf = DeviceMemoryResource(dev).allocate(SIZE, stream=stream)
    pinned = PinnedMemoryResource().allocate(SIZE, stream=stream)
    pageable = np.empty(SIZE, dtype=np.uint8)
    pageable[::4096] = 1  # touched: the first-touch cost is not the copy's
    stream.sync()

    def timed(fn: Callable[[], None]) -> float:
        fn()  # warm-up
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    def d2h_pageable() -> None:
        (err,) = driver.cuMemcpyDtoH(pageable.ctypes.data, int(dbuf.handle), SIZE)
        assert err == driver.CUresult.CUDA_SUCCESS, err

    def h2d_pageable() -> None:
        (err,) = driver.cuMemcpyHtoD(int(dbuf.handle), pageable.ctypes.data, SIZE)
        assert err == driver.CUresult.CUDA_SUCCESS, err

    def d2h_pinned() -> None:
        dbuf.copy_to(pinned, stream=stream)
        stream.sync()

    def h2d_pinned() -> None:
        dbuf.copy_from(pinned, stream=stream)
        stream.sync()

    report("device->host, pageable (cuMemcpyDtoH)", SIZE, timed(d2h_pageable))
    report("host->device, pageable (cuMemcpyHtoD)", SIZE, timed(h2d_pageable))
    report("device->host, pinned (async + sync)", SIZE, timed(d2h_pinned))
    report("host->device, pinned (async + sync)", SIZE, timed(h2d_pinned))
    pipeline(dev, dbuf)
    pinned.close()
    dbuf.close()


def pipeline(dev: Any, src: Any) -> None:
    """Device -> pinned -> TCP -> pinned -> device, chunked, with ``SLOTS`` staging chunks per side."""
    from cuda.core import DeviceMemoryResource, PinnedMemoryResource

    dst = DeviceMemoryResource(dev).allocate(SIZE, stream=dev.default_stream)
    chunks = [(off, min(CHUNK, SIZE - off)) for off in range(0, SIZE, CHUNK)]

    def run(pairs: list[tuple[socket.socket, socket.socket]]) -> float:
        errors: list[BaseException] = []
        # stream k carries chunks k, k+len(pairs), ...
        lanes = [chunks[k :: len(pairs)] for k in range(len(pairs))]

        def sender(sock: socket.socket, lane: list[tuple[int, int]]) -> None:
            try:
                dev.set_current()
                s = dev.create_stream()
                slots = [PinnedMemoryResource().allocate(CHUNK, stream=s) for _ in range(SLOTS)]
                events: list[Any] = [None] * len(lane)

                def issue(i: int) -> None:
                    off, n = lane[i]
                    stage = slots[i % SLOTS]
                    # the chunk's device range -> the slot (a Buffer view of src at off)
                    from cuda.core import Buffer

                    part = Buffer.from_handle(int(src.handle) + off, n, owner=src)
                    part.copy_to(Buffer.from_handle(int(stage.handle), n, owner=stage), stream=s)
                    events[i] = s.record()

                for i in range(min(SLOTS - 1, len(lane))):
                    issue(i)
                for i, (_off, n) in enumerate(lane):
                    if i + SLOTS - 1 < len(lane):
                        issue(i + SLOTS - 1)  # the slot of chunk i-1, already sent
                    events[i].sync()
                    sock.sendall(view(int(slots[i % SLOTS].handle), n))
                s.sync()
            except BaseException as e:  # reported by the caller
                errors.append(e)

        def receiver(sock: socket.socket, lane: list[tuple[int, int]]) -> None:
            try:
                dev.set_current()
                s = dev.create_stream()
                slots = [PinnedMemoryResource().allocate(CHUNK, stream=s) for _ in range(SLOTS)]
                done: list[Any] = [None] * SLOTS
                from cuda.core import Buffer

                for i, (off, n) in enumerate(lane):
                    k = i % SLOTS
                    if done[k] is not None:
                        done[k].sync()  # the slot's last host->device copy finished
                    recv_exactly(sock, view(int(slots[k].handle), n))
                    part = Buffer.from_handle(int(dst.handle) + off, n, owner=dst)
                    part.copy_from(Buffer.from_handle(int(slots[k].handle), n, owner=slots[k]), stream=s)
                    done[k] = s.record()
                s.sync()
            except BaseException as e:
                errors.append(e)

        threads = [threading.Thread(target=sender, args=(a, lane)) for (a, _), lane in zip(pairs, lanes, strict=True)]
        threads += [
            threading.Thread(target=receiver, args=(b, lane)) for (_, b), lane in zip(pairs, lanes, strict=True)
        ]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return time.perf_counter() - t0

    for k in (1, STREAMS):
        pairs = [tcp_pair() for _ in range(k)]
        run(pairs)  # warm-up (pinned staging allocated, connections warm)
        report(f"pipeline d->h->tcp->h->d, {k} stream(s), {SLOTS} x {CHUNK >> 20} MiB", SIZE, run(pairs))
        for a, b in pairs:
            a.close()
            b.close()
    dst.close()


def main() -> None:
    print(f"size {SIZE >> 20} MiB, chunk {CHUNK >> 20} MiB, {SLOTS} slots, {STREAMS} streams", flush=True)
    sockets()
    try:
        from cuda.core import Device

        from dask_gpupool.memory.topology import local_devices

        if not local_devices().uuids:
            raise RuntimeError("no GPU visible")
        dev = Device(0)
        dev.set_current()
    except Exception as e:
        print(f"no GPU here ({type(e).__name__}: {e}): copies and the pipeline are skipped")
        return
    copies(dev)


if __name__ == "__main__":
    main()
