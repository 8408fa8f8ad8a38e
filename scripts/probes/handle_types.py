"""Probe: which shareable handle types this machine's GPUs give, and what a legacy IPC importer reads after its
exporter died.

Two questions behind the segment memory of UCX workers (``docs/design.md``, "Pool memory to another host over UCX"):

1. UCX 1.21's ``cuda_ipc`` sends VMM and pool memory only through *fabric* handles (``cuMemExportToShareableHandle``
   with ``CU_MEM_HANDLE_TYPE_FABRIC``). Can this machine make VMM memory (``cuMemCreate``) or a memory pool
   (``cuMemPoolCreate``) that allows fabric handles, with or without POSIX file descriptors beside them, and export
   one? Prints the device attributes, the IMEX channel devices, and each ``cuMemCreate`` attempt's ``CUresult``.
   (``cuMemPoolCreate`` with ``handleTypes`` set from Python crashed cuda-bindings 13.3.1 on an H100, so pools are
   not tried; a pool's fabric export needs the same IMEX channel as ``cuMemCreate``'s.)
2. Segments of ``cuMemAlloc`` memory shared by legacy IPC handles would let UCX send pool memory as it is. What does an
   importer read when the exporting process is SIGKILLed while the importer holds the mapping, and then another
   process allocates and writes memory? (The driver reference calls freeing before the importer closed it undefined.)
   Three processes: A allocates ``SIZE`` bytes, writes 0xA5 and exports a legacy handle; B opens it and reads; A is
   SIGKILLed; C allocates ``REUSE`` bytes in ``SIZE`` pieces and writes 0x5A; B reads again, then checks that its own
   context still works. The same is done with VMM memory shared as a POSIX fd (the memory dask_gpupool's segments
   use) for comparison. ``PROBE_READER_GPU=1`` puts B on a second GPU (the memory stays on GPU 0): pool memory
   imported across GPUs was lost with its exporter where on one GPU it was not (``dask_gpupool.memory.vmm``).

Run: ``python3 scripts/probes/handle_types.py`` (PROBE_SIZE, PROBE_REUSE). Needs cuda.bindings and one GPU.
"""

from __future__ import annotations

import glob
import multiprocessing as mp
import os
import signal
import sys
import time
from multiprocessing import reduction
from typing import Any

SIZE = int(os.environ.get("PROBE_SIZE", 64 << 20))
REUSE = int(os.environ.get("PROBE_REUSE", 8 << 30))
#: The GPU the reader runs on (the memory is on GPU 0): 1 on a machine with two GPUs reads across them.
READER_GPU = int(os.environ.get("PROBE_READER_GPU", 0))


def _driver(ordinal: int = 0) -> Any:
    from cuda.bindings import driver

    (err,) = driver.cuInit(0)
    assert err == driver.CUresult.CUDA_SUCCESS, err
    err, dev = driver.cuDeviceGet(ordinal)
    err, ctx = driver.cuDevicePrimaryCtxRetain(dev)
    assert err == driver.CUresult.CUDA_SUCCESS, err
    (err,) = driver.cuCtxSetCurrent(ctx)
    assert err == driver.CUresult.CUDA_SUCCESS, err
    return driver


def _name(err: Any) -> str:
    return getattr(err, "name", str(err))


def _prop(driver: Any, handle_types: int) -> Any:
    prop = driver.CUmemAllocationProp()
    prop.type = driver.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = 0
    prop.requestedHandleTypes = handle_types
    return prop


def handle_types() -> None:
    driver = _driver()
    attr = driver.CUdevice_attribute
    for name in (
        "CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED",
        "CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED",
        "CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED",
        "CU_DEVICE_ATTRIBUTE_IPC_EVENT_SUPPORTED",
        "CU_DEVICE_ATTRIBUTE_MEMPOOL_SUPPORTED_HANDLE_TYPES",
    ):
        a = getattr(attr, name, None)
        value = "unknown attribute" if a is None else driver.cuDeviceGetAttribute(a, 0)
        print(f"attribute {name}: {value}", flush=True)
    print(f"IMEX channel devices: {sorted(glob.glob('/dev/nvidia-caps-imex-channels/*')) or 'none'}", flush=True)
    H = driver.CUmemAllocationHandleType
    fabric, fd = int(H.CU_MEM_HANDLE_TYPE_FABRIC), int(H.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
    err, gran = driver.cuMemGetAllocationGranularity(
        _prop(driver, fd), driver.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
    )
    for label, types in (("fabric", fabric), ("posix-fd|fabric", fd | fabric), ("posix-fd", fd)):
        err, handle = driver.cuMemCreate(gran, _prop(driver, types), 0)
        line = f"cuMemCreate({label}): {_name(err)}"
        if err == driver.CUresult.CUDA_SUCCESS:
            if types & fabric:
                err2, _fh = driver.cuMemExportToShareableHandle(handle, H.CU_MEM_HANDLE_TYPE_FABRIC, 0)
                line += f"; export fabric: {_name(err2)}"
            driver.cuMemRelease(handle)
        print(line, flush=True)


# --- part 2: an importer's reads after its exporter was SIGKILLed --------------------------------------------


def _vmm_alloc(driver: Any, size: int) -> tuple[Any, int]:
    H = driver.CUmemAllocationHandleType
    prop = _prop(driver, int(H.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR))
    err, handle = driver.cuMemCreate(size, prop, 0)
    assert err == driver.CUresult.CUDA_SUCCESS, err
    return handle, _map(driver, handle, size)


def _map(driver: Any, handle: Any, size: int, ordinal: int = 0) -> int:
    err, ptr = driver.cuMemAddressReserve(size, 0, 0, 0)
    assert err == driver.CUresult.CUDA_SUCCESS, err
    assert driver.cuMemMap(ptr, size, 0, handle, 0)[0] == driver.CUresult.CUDA_SUCCESS
    acc = driver.CUmemAccessDesc()
    acc.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    acc.location.id = ordinal
    acc.flags = driver.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    assert driver.cuMemSetAccess(ptr, size, [acc], 1)[0] == driver.CUresult.CUDA_SUCCESS
    return int(ptr)


def exporter(conn: Any, kind: str) -> None:
    driver = _driver()
    if kind == "legacy":
        err, ptr = driver.cuMemAlloc(SIZE)
        assert err == driver.CUresult.CUDA_SUCCESS, err
        driver.cuMemsetD8(ptr, 0xA5, SIZE)
        driver.cuCtxSynchronize()
        err, h = driver.cuIpcGetMemHandle(ptr)
        assert err == driver.CUresult.CUDA_SUCCESS, err
        conn.send(bytes(h.reserved))
    else:
        handle, ptr = _vmm_alloc(driver, SIZE)
        driver.cuMemsetD8(ptr, 0xA5, SIZE)
        driver.cuCtxSynchronize()
        err, fd = driver.cuMemExportToShareableHandle(
            handle, driver.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0
        )
        assert err == driver.CUresult.CUDA_SUCCESS, err
        conn.send("fd")
        reduction.send_handle(conn, int(fd), os.getppid())
    time.sleep(3600)


def reuser(conn: Any) -> None:
    driver = _driver()
    kept = []
    while len(kept) * SIZE < REUSE:
        err, ptr = driver.cuMemAlloc(SIZE)
        if err != driver.CUresult.CUDA_SUCCESS:
            break
        driver.cuMemsetD8(ptr, 0x5A, SIZE)
        kept.append(ptr)
    driver.cuCtxSynchronize()
    conn.send(len(kept) * SIZE)
    time.sleep(3600)


def reader(conn: Any, kind: str, payload: Any) -> None:
    driver = _driver(READER_GPU)
    if kind == "legacy":
        h = driver.CUipcMemHandle()
        h.reserved = payload
        err, ptr = driver.cuIpcOpenMemHandle(h, driver.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS)
        assert err == driver.CUresult.CUDA_SUCCESS, err
        ptr = int(ptr)
    else:
        fd = reduction.recv_handle(conn)
        err, handle = driver.cuMemImportFromShareableHandle(
            fd, driver.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        )
        assert err == driver.CUresult.CUDA_SUCCESS, err
        os.close(fd)
        ptr = _map(driver, handle, SIZE, READER_GPU)
    host = bytearray(SIZE)

    def read(when: str) -> None:
        (err,) = driver.cuMemcpyDtoH(host, ptr, SIZE)
        if err != driver.CUresult.CUDA_SUCCESS:
            conn.send(f"{when}: cuMemcpyDtoH {_name(err)}")
            return
        values = {b: host.count(b) for b in set(host[:: 1 << 16])}
        conn.send(
            f"{when}: read ok, byte values sampled {{{', '.join(f'0x{b:02X}' for b in sorted(values))}}}, "
            f"0xA5 bytes {host.count(0xA5)} of {SIZE}"
        )

    read("before the exporter's SIGKILL")
    conn.recv()  # the exporter was killed
    read("after the exporter's SIGKILL")
    conn.recv()  # another process allocated and wrote
    read("after another process wrote new allocations")
    err, own = driver.cuMemAlloc(1 << 20)
    ok = err == driver.CUresult.CUDA_SUCCESS and driver.cuMemsetD8(own, 1, 1 << 20)[0] == driver.CUresult.CUDA_SUCCESS
    (err,) = driver.cuCtxSynchronize()
    works = ok and err == driver.CUresult.CUDA_SUCCESS
    conn.send(f"reader's own context afterwards: {'works' if works else _name(err)}")
    conn.send(None)


def after_exporter_death(kind: str) -> None:
    ctx = mp.get_context("spawn")
    a_conn, a_child = ctx.Pipe()
    a = ctx.Process(target=exporter, args=(a_child, kind))
    a.start()
    payload = a_conn.recv()
    b_conn, b_child = ctx.Pipe()
    if kind == "legacy":
        b = ctx.Process(target=reader, args=(b_child, kind, payload))
        b.start()
    else:
        fd = reduction.recv_handle(a_conn)
        b = ctx.Process(target=reader, args=(b_child, kind, None))
        b.start()
        reduction.send_handle(b_conn, fd, b.pid)
        os.close(fd)
    print(f"[{kind}, reader on GPU {READER_GPU}] {b_conn.recv()}", flush=True)
    os.kill(a.pid, signal.SIGKILL)
    a.join()
    time.sleep(1.0)
    b_conn.send("killed")
    print(f"[{kind}, reader on GPU {READER_GPU}] {b_conn.recv()}", flush=True)
    c_conn, c_child = ctx.Pipe()
    c = ctx.Process(target=reuser, args=(c_child,))
    c.start()
    print(
        f"[{kind}, reader on GPU {READER_GPU}] another process allocated and wrote {c_conn.recv() >> 20} MiB (0x5A)",
        flush=True,
    )
    b_conn.send("reused")
    while (msg := b_conn.recv()) is not None:
        print(f"[{kind}, reader on GPU {READER_GPU}] {msg}", flush=True)
    for p in (b, c):
        p.kill()
        p.join()


if __name__ == "__main__":
    handle_types()
    for kind in sys.argv[1:] or ["vmm", "legacy"]:
        try:
            after_exporter_death(kind)
        except Exception as e:  # a reader that died (its context lost) ends the pipe
            print(f"[{kind}, reader on GPU {READER_GPU}] probe ended: {type(e).__name__}: {e}", flush=True)
