"""Probe: rounds of cross-GPU export / import / release / reuse with cuda.core alone (2 GPUs).

``python3 scripts/probes/two_gpu_rounds.py [name filter...]``: per variant a
fresh exporter (GPU 0) and importer (GPU 1, rotated ``CUDA_VISIBLE_DEVICES``).
Each round the exporter makes ``n`` buffers (memset to a round-specific
value), the importer imports and reads them, closes its imports and
synchronizes, and only then does the exporter free them and scribble over
the freed memory (allocate, memset 0, free), as the Dask stress test does.
Prints how many rounds passed, or the first failure.
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import sys
import time
import traceback
from typing import Any

MiB = 1 << 20


def _check(res: Any) -> Any:
    from cuda.bindings import driver

    if res[0] != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(repr(res[0]))
    return res[1:]


def _set_threshold(mr: Any) -> None:
    from cuda.bindings import driver

    attr = driver.CUmemPool_attribute.CU_MEMPOOL_ATTR_RELEASE_THRESHOLD
    _check(driver.cuMemPoolSetAttribute(mr.handle, attr, driver.cuuint64_t(2**64 - 1)))


def exporter(conn: Any, rounds: int, n: int, size: int, opts: dict[str, Any]) -> None:
    os.environ["CUDA_VISIBLE_DEVICES"] = "0,1"
    from multiprocessing import reduction

    from cuda.bindings import driver
    from cuda.core import Device, DeviceMemoryResource, DeviceMemoryResourceOptions

    dev = Device(0)
    dev.set_current()
    s = dev.default_stream
    mr = DeviceMemoryResource(0, DeviceMemoryResourceOptions(ipc_enabled=True, max_size=2 << 30))
    if opts.get("exporter_grant"):
        mr.peer_accessible_by = {1}
    if opts.get("threshold"):
        _set_threshold(mr)
    reduction.send_handle(conn, int(mr.allocation_handle), int(conn.recv()))
    prev: list[Any] = []
    overlap = opts.get("overlap")
    for r in range(rounds):
        bufs = []
        for i in range(n):
            b = mr.allocate(size, stream=s)
            _check(driver.cuMemsetD8Async(int(b.handle), (r * n + i) % 250 + 1, size, s.handle))
            bufs.append(b)
        dev.sync()
        descs = []
        for b in bufs:
            _, (payload, sz) = b.ipc_descriptor.__reduce__()
            descs.append((bytes(payload), sz))
        conn.send(descs)
        if opts.get("busy"):  # grow and shrink the pool while the importer imports and reads
            while not conn.poll():
                ts = [mr.allocate(size, stream=s) for _ in range(n)]
                for t in ts:
                    _check(driver.cuMemsetD8Async(int(t.handle), 0, size, s.handle))
                    t.close(s)
                dev.sync()
        if conn.recv() != "released":
            break
        # Without overlap the importer released this round's buffers; with it, the previous round's.
        done, prev = (prev, bufs) if overlap else (bufs, [])
        for b in done:
            b.close(s)
        for _ in range(n):
            t = mr.allocate(size, stream=s)
            _check(driver.cuMemsetD8Async(int(t.handle), 0, size, s.handle))
            t.close(s)
        dev.sync()
    conn.send(None)
    mr.close()


def importer(conn: Any, rounds: int, n: int, size: int, opts: dict[str, Any], out: Any) -> None:
    os.environ["CUDA_VISIBLE_DEVICES"] = "1,0"
    from multiprocessing import reduction

    from cuda.bindings import driver
    from cuda.core import Buffer, Device, DeviceMemoryResource
    from cuda.core._memory._ipc import IPCBufferDescriptor

    conn.send(os.getpid())
    done = 0
    result = ""
    try:
        own = Device(0)
        own.set_current()
        fd = reduction.recv_handle(conn)
        mr = DeviceMemoryResource.from_allocation_handle(1, fd)
        os.close(fd)
        own.set_current()
        mr.peer_accessible_by = {0}
        if opts.get("ctx_peer"):  # what CuPy does for an array whose device_id is the owner's GPU
            owner = Device(1)
            owner.set_current()
            owner_ctx = owner.context.handle
            own.set_current()
            _check((driver.cuCtxEnablePeerAccess(owner_ctx, 0)[0],))
        prev: list[Any] = []
        overlap = opts.get("overlap")
        for r in range(rounds):
            descs = conn.recv()
            if overlap == "close-first":  # free the previous round's imports, unsynchronized, then import
                for b in prev:
                    b.close(own.default_stream)
            bufs = [
                Buffer.from_ipc_descriptor(mr, IPCBufferDescriptor._init(p, sz), stream=own.default_stream)
                for p, sz in descs
            ]
            if overlap == "import-first":
                for b in prev:
                    b.close(own.default_stream)
            if opts.get("cupy"):  # read every byte with a kernel on this GPU, as the Dask test does
                import cupy

                for i, b in enumerate(bufs):
                    mem = cupy.cuda.UnownedMemory(int(b.handle), size, b, device_id=0)
                    arr = cupy.ndarray((size,), "u1", cupy.cuda.MemoryPointer(mem, 0))
                    if not bool((arr == (r * n + i) % 250 + 1).all()):
                        raise AssertionError(f"round {r} buffer {i}: wrong bytes (kernel)")
            for i, b in enumerate(bufs):
                one = ctypes.create_string_buffer(1)
                _check(driver.cuMemcpy(ctypes.addressof(one), int(b.handle) + size - 1, 1))
                if one.raw[0] != (r * n + i) % 250 + 1:
                    raise AssertionError(f"round {r} buffer {i}: read {one.raw[0]}")
            if overlap:
                prev = bufs
            else:
                for b in bufs:
                    b.close(own.default_stream)
            own.sync()
            if opts.get("sleep"):
                time.sleep(opts["sleep"])
            conn.send("released")
            done += 1
        conn.recv()
        mr.close()
        result = f"ok, {done} rounds"
    except Exception as e:
        result = f"FAILED in round {done}: {type(e).__name__}: {e}"
        traceback.print_exc()
        conn.send("failed")
    finally:
        out.put(result)


def variant(name: str, rounds: int, n: int, size: int, **opts: Any) -> str:
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    q = ctx.Queue()
    pe = ctx.Process(target=exporter, args=(a, rounds, n, size, opts))
    pi = ctx.Process(target=importer, args=(b, rounds, n, size, opts, q))
    pe.start()
    pi.start()
    t0 = time.monotonic()
    try:
        result = q.get(timeout=120)
    except Exception as e:
        result = f"TIMEOUT {e}"
    took = time.monotonic() - t0
    for p in (pe, pi):
        p.join(20)
        if p.is_alive():
            p.kill()
    return f"{name:44s} {result[:160]}  ({took:.1f} s)"


def main() -> None:
    only = sys.argv[1:]
    grant: dict[str, Any] = {"exporter_grant": True}
    variants: list[tuple[str, int, int, int, dict[str, Any]]] = [
        ("rounds 8 x 16MiB", 40, 8, 16 * MiB, {}),
        ("rounds 8 x 16MiB, exporter grant", 40, 8, 16 * MiB, {"exporter_grant": True}),
        ("rounds 8 x 16MiB, threshold", 40, 8, 16 * MiB, {"threshold": True}),
        ("rounds 8 x 16MiB, exporter grant + threshold", 40, 8, 16 * MiB, {"exporter_grant": True, "threshold": True}),
        ("rounds 8 x 16MiB, overlap close-first", 40, 8, 16 * MiB, {"overlap": "close-first"}),
        ("rounds 8 x 16MiB, overlap import-first", 40, 8, 16 * MiB, {"overlap": "import-first"}),
        (
            "rounds 8 x 16MiB, overlap close-first, grant",
            40,
            8,
            16 * MiB,
            {"overlap": "close-first", **grant},
        ),
        (
            "rounds 8 x 16MiB, overlap import-first, grant",
            40,
            8,
            16 * MiB,
            {"overlap": "import-first", **grant},
        ),
        ("rounds 8 x 16MiB, ctx peer", 40, 8, 16 * MiB, {"ctx_peer": True}),
        ("rounds 8 x 16MiB, ctx peer, grant", 40, 8, 16 * MiB, {"ctx_peer": True, **grant}),
        (
            "rounds 8 x 16MiB, ctx peer, overlap close-first, grant",
            40,
            8,
            16 * MiB,
            {"ctx_peer": True, "overlap": "close-first", **grant},
        ),
        ("rounds 8 x 16MiB, busy, grant", 40, 8, 16 * MiB, {"busy": True, **grant}),
        ("rounds 8 x 16MiB, busy, cupy, grant", 40, 8, 16 * MiB, {"busy": True, "cupy": True, **grant}),
        (
            "rounds 8 x 16MiB, busy, cupy, grant, threshold",
            40,
            8,
            16 * MiB,
            {"busy": True, "cupy": True, "threshold": True, **grant},
        ),
        ("rounds 8 x 16MiB, busy, cupy", 40, 8, 16 * MiB, {"busy": True, "cupy": True}),
        ("rounds 8 x 1MiB", 40, 8, MiB, {}),
        ("rounds 8 x 1MiB, exporter grant", 40, 8, MiB, {"exporter_grant": True}),
    ]
    for name, rounds, n, size, opts in variants:
        if not only or any(o in name for o in only):
            print(variant(name, rounds, n, size, **opts), flush=True)


if __name__ == "__main__":
    main()
