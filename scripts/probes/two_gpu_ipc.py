"""Probe: cross-GPU pool IPC with cuda.core alone (no Dask), GPU machine with 2 GPUs.

``python3 scripts/probes/two_gpu_ipc.py``: for each variant, a fresh exporter
(GPU 0, ``CUDA_VISIBLE_DEVICES=0,1``) and importer (GPU 1, ``1,0``), both
spawned. The exporter makes ``n`` buffers of ``size`` bytes in an IPC pool,
fills buffer ``i`` with byte ``i + 1``, synchronizes and sends the pool's fd
and the descriptors. The importer maps the pool on the owner's ordinal (1
there), grants its own GPU access, imports every buffer and reads the first
and last byte of each. Prints ``ok``, ``WRONG`` or the first error.
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import sys
import traceback
from typing import Any

MiB = 1 << 20


def _check(res: Any) -> Any:
    from cuda.bindings import driver

    err = res[0]
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(repr(err))
    return res[1:] if len(res) > 1 else None


def exporter(conn: Any, n: int, size: int, opts: dict[str, Any]) -> None:
    os.environ["CUDA_VISIBLE_DEVICES"] = "0,1"
    from multiprocessing import reduction

    from cuda.bindings import driver
    from cuda.core import Device, DeviceMemoryResource, DeviceMemoryResourceOptions

    dev = Device(0)
    dev.set_current()
    mr = DeviceMemoryResource(0, DeviceMemoryResourceOptions(ipc_enabled=True, max_size=opts.get("max_size", 2 << 30)))
    bufs: list[Any] = []

    def make(i: int) -> tuple[bytes, int]:
        b = mr.allocate(size, stream=dev.default_stream)
        if opts.get("write") == "ends":  # like the Dask probe's make_buffer: two 1-byte writes
            dev.sync()
            for off in (0, size - 1):
                one = ctypes.create_string_buffer(bytes([i + 1]), 1)
                _check(driver.cuMemcpy(int(b.handle) + off, ctypes.addressof(one), 1))
        else:
            _check(driver.cuMemsetD8Async(int(b.handle), i + 1, size, dev.default_stream.handle))
        dev.sync()
        bufs.append(b)
        _, (payload, sz) = b.ipc_descriptor.__reduce__()
        return bytes(payload), sz

    pid = int(conn.recv())
    if opts.get("interleave"):
        # Like Dask: the importer maps the pool and buffer i while this process makes buffer i + 1.
        first = make(0)
        reduction.send_handle(conn, int(mr.allocation_handle), pid)
        conn.send([first])
        for i in range(1, n):
            if not opts.get("free_run"):
                conn.recv()  # the importer imported the previous one
            conn.send([make(i)])
    else:
        descs = [make(i) for i in range(n)]
        reduction.send_handle(conn, int(mr.allocation_handle), pid)
        conn.send(descs)
    while conn.recv() != "done":  # acks, then the importer is done
        pass
    for b in bufs:
        b.close(dev.default_stream)
    dev.sync()
    mr.close()


def importer(conn: Any, n: int, size: int, opts: dict[str, Any], out: Any) -> None:
    os.environ["CUDA_VISIBLE_DEVICES"] = "1,0"
    from multiprocessing import reduction

    from cuda.bindings import driver
    from cuda.core import Buffer, Device, DeviceMemoryResource, DeviceMemoryResourceOptions
    from cuda.core._memory._ipc import IPCBufferDescriptor

    result = "ok"
    conn.send(os.getpid())
    try:
        own, owner = Device(0), Device(1)
        own.set_current()
        if opts.get("own_pool"):
            mine = DeviceMemoryResource(0, DeviceMemoryResourceOptions(ipc_enabled=True, max_size=2 << 30))
            tmp = mine.allocate(64 * MiB, stream=own.default_stream)
            tmp.close(own.default_stream)
        if opts.get("owner_ctx"):
            owner.set_current()
        fd = reduction.recv_handle(conn)
        mr = DeviceMemoryResource.from_allocation_handle(1, fd)  # the owner's GPU is ordinal 1 here
        os.close(fd)
        own.set_current()

        def grant() -> None:
            if opts.get("raw_access"):
                desc = driver.CUmemAccessDesc()
                desc.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
                desc.location.id = 0
                desc.flags = driver.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
                _check(driver.cuMemPoolSetAccess(mr.handle, [desc], 1))
            else:
                mr.peer_accessible_by = {0}

        if opts.get("access", "before") == "before":
            grant()
        bufs = []
        while len(bufs) < n:
            for payload, sz in conn.recv():
                if opts.get("owner_ctx"):
                    owner.set_current()
                    stream = owner.default_stream
                else:
                    own.set_current()
                    stream = own.default_stream
                b = Buffer.from_ipc_descriptor(mr, IPCBufferDescriptor._init(payload, sz), stream=stream)
                bufs.append(b)
                if opts.get("sync_each"):
                    own.sync()
                if opts.get("access") == "each":
                    grant()
            conn.send("ack")
        if opts.get("access") == "after":
            grant()
        own.set_current()
        got = []
        for b in bufs:
            one = ctypes.create_string_buffer(1)
            _check(driver.cuMemcpy(ctypes.addressof(one), int(b.handle), 1))
            last = ctypes.create_string_buffer(1)
            _check(driver.cuMemcpy(ctypes.addressof(last), int(b.handle) + size - 1, 1))
            got.append((one.raw[0], last.raw[0]))
        if any(g != (i + 1, i + 1) for i, g in enumerate(got)):
            result = f"WRONG {got}"
        for b in bufs:
            b.close(own.default_stream)
        own.sync()
        mr.close()
    except Exception as e:
        result = f"FAILED {type(e).__name__}: {e}"
        traceback.print_exc()
    finally:
        conn.send("done")
        out.put(result)


def variant(name: str, n: int, size: int, **opts: Any) -> str:
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    q = ctx.Queue()
    pe = ctx.Process(target=exporter, args=(a, n, size, opts))
    pi = ctx.Process(target=importer, args=(b, n, size, opts, q))
    pe.start()
    pi.start()
    try:
        result = q.get(timeout=120)
    except Exception as e:
        result = f"TIMEOUT {e}"
    pe.join(30)
    pi.join(30)
    for p in (pe, pi):
        if p.is_alive():
            p.kill()
    return f"{name:44s} {result[:200]}"


def main() -> None:
    only = sys.argv[1:]
    il = {"interleave": True}
    variants: list[tuple[str, int, int, dict[str, Any]]] = [
        ("8 x 16MiB interleaved", 8, 16 * MiB, il),
        ("8 x 16MiB interleaved, ends", 8, 16 * MiB, {**il, "write": "ends"}),
        ("8 x 16MiB ends", 8, 16 * MiB, {"write": "ends"}),
        ("8 x 16MiB interleaved, access each", 8, 16 * MiB, {**il, "access": "each"}),
        ("8 x 16MiB interleaved, access after", 8, 16 * MiB, {**il, "access": "after"}),
        ("8 x 1MiB interleaved", 8, MiB, il),
        ("8 x 16MiB free-running", 8, 16 * MiB, {**il, "free_run": True}),
        ("8 x 16MiB free-running, ends", 8, 16 * MiB, {**il, "free_run": True, "write": "ends"}),
        ("32 x 16MiB free-running, ends", 32, 16 * MiB, {**il, "free_run": True, "write": "ends"}),
        ("8 x 64MiB interleaved", 8, 64 * MiB, il),
        ("1 x 16MiB", 1, 16 * MiB, {}),
        ("8 x 1MiB", 8, MiB, {}),
        ("8 x 16MiB", 8, 16 * MiB, {}),
        ("8 x 16MiB again", 8, 16 * MiB, {}),
        ("2 x 16MiB", 2, 16 * MiB, {}),
        ("4 x 16MiB", 4, 16 * MiB, {}),
        ("8 x 16MiB own_pool", 8, 16 * MiB, {"own_pool": True}),
        ("8 x 16MiB raw_access", 8, 16 * MiB, {"raw_access": True}),
        ("8 x 16MiB access after", 8, 16 * MiB, {"access": "after"}),
        ("8 x 16MiB access each", 8, 16 * MiB, {"access": "each"}),
        ("8 x 16MiB sync_each", 8, 16 * MiB, {"sync_each": True}),
        ("8 x 16MiB owner_ctx", 8, 16 * MiB, {"owner_ctx": True}),
        ("1 x 128MiB", 1, 128 * MiB, {}),
        ("8 x 16MiB max_size 0", 8, 16 * MiB, {"max_size": 0}),
        ("32 x 4MiB", 32, 4 * MiB, {}),
    ]
    for name, n, size, opts in variants:
        if only and not any(o in name for o in only):
            continue
        print(variant(name, n, size, **opts), flush=True)


if __name__ == "__main__":
    main()
