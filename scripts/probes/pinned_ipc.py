"""Probe: can a process read a peer's IPC-enabled PinnedMemoryResource buffer, and how?

Run on the GPU machine: ``python3 scripts/probes/pinned_ipc.py``. The exporter (this
process) makes a pinned IPC pool and fills one buffer with a pattern; each read method runs in
a fresh spawned child (so a crash or a hang in one does not hide the others) that imports the
pool by fd (SCM_RIGHTS over a socketpair) and the buffer by descriptor. Prints one line per
method: ok / wrong data / error / crashed (signal) / hung.
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import socket
import sys

# PROBE_SIZE: bytes of the buffer; PROBE_MAX: the pool's max_size; PROBE_NOSYNC=1: no sync after
# allocating; PROBE_THREAD=1: the child imports and reads on a second thread.
N = int(os.environ.get("PROBE_SIZE", 1 << 20))
MAX = int(os.environ.get("PROBE_MAX", 64 << 20))
PATTERN = (bytes(range(256)) * (N // 256 + 1))[:N]


def _check(err, what):
    from cuda.bindings import driver

    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"{what}: {err!r}")


def _access(pool, loc_type, loc_id):
    from cuda.bindings import driver

    loc = driver.CUmemLocation()
    loc.type = loc_type
    loc.id = loc_id
    err, flags = driver.cuMemPoolGetAccess(pool, loc)
    return f"{err.name}:{flags.name if hasattr(flags, 'name') else flags}"


def _set_access(pool, loc_type, loc_id):
    from cuda.bindings import driver

    desc = driver.CUmemAccessDesc()
    desc.location.type = loc_type
    desc.location.id = loc_id
    desc.flags = driver.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    (err,) = driver.cuMemPoolSetAccess(pool, [desc], 1)
    return err.name


def child(method, sock, payload, size):
    if os.environ.get("PROBE_THREAD") == "1":
        import threading

        t = threading.Thread(target=_child, args=(method, sock, payload, size))
        t.start()
        t.join()
    else:
        _child(method, sock, payload, size)


def _child(method, sock, payload, size):
    from cuda.bindings import driver
    from cuda.core import Buffer, Device, PinnedMemoryResource
    from cuda.core._memory._ipc import IPCBufferDescriptor

    T = driver.CUmemLocationType
    dev = Device(0)
    dev.set_current()
    if method.startswith("ownpool"):
        from cuda.core import PinnedMemoryResourceOptions

        own = PinnedMemoryResource(PinnedMemoryResourceOptions(ipc_enabled=True, max_size=64 << 20))
        own_buf = own.allocate(N, stream=dev.default_stream)
        _ = int(own.allocation_handle)
        print(f"  {method}: own pool buffer at {int(own_buf.handle):#x}", flush=True)
    _, fds, _, _ = socket.recv_fds(sock, 16, 1)
    mr = PinnedMemoryResource.from_allocation_handle(fds[0])
    os.close(fds[0])
    notes = [
        "access dev0=" + _access(mr.handle, T.CU_MEM_LOCATION_TYPE_DEVICE, 0),
        "host_numa0=" + _access(mr.handle, T.CU_MEM_LOCATION_TYPE_HOST_NUMA, 0),
        "host=" + _access(mr.handle, T.CU_MEM_LOCATION_TYPE_HOST, 0),
    ]
    if "sethost" in method:
        notes.append("set host_numa0 -> " + _set_access(mr.handle, T.CU_MEM_LOCATION_TYPE_HOST_NUMA, 0))
    if "setdev" in method:
        notes.append("set dev0 -> " + _set_access(mr.handle, T.CU_MEM_LOCATION_TYPE_DEVICE, 0))
    stream = dev.create_stream()
    buf = Buffer.from_ipc_descriptor(mr, IPCBufferDescriptor._init(payload, size), stream=stream)
    notes.append(f"ptr={int(buf.handle):#x}")
    print(f"  {method}: {'; '.join(notes)}", flush=True)
    if method.endswith("cpu"):
        got = ctypes.string_at(int(buf.handle), size)
    elif method.endswith("gpucopy"):
        from cuda.core import DeviceMemoryResource

        dst = DeviceMemoryResource(dev).allocate(size, stream=stream)
        dst.copy_from(buf, stream=stream)
        stream.sync()
        host = (ctypes.c_char * size)()
        _check(driver.cuMemcpyDtoH(ctypes.addressof(host), int(dst.handle), size)[0], "cuMemcpyDtoH")
        got = bytes(host)
        dst.close(stream)
    elif method.endswith("memcpy"):
        host = (ctypes.c_char * size)()
        _check(driver.cuMemcpyAsync(ctypes.addressof(host), int(buf.handle), size, stream.handle)[0], "cuMemcpyAsync")
        stream.sync()
        got = bytes(host)
    else:
        raise ValueError(method)
    buf.close(stream)
    stream.sync()
    mr.close()
    print(f"  {method}: {'ok' if got == PATTERN[:size] else 'WRONG DATA'}", flush=True)


def main():
    from cuda.core import Device, PinnedMemoryResource, PinnedMemoryResourceOptions

    ctx = mp.get_context("spawn")
    dev = Device(0)
    dev.set_current()
    nodes = [d for d in os.listdir("/sys/devices/system/node") if d.startswith("node") and d[4:].isdigit()]
    print(f"numa nodes: {len(nodes)}; gpu0 host_numa_id: {getattr(dev.properties, 'host_numa_id', '?')}")
    print(f"size {N} max_size {MAX} nosync {os.environ.get('PROBE_NOSYNC')} thread {os.environ.get('PROBE_THREAD')}")
    mr = PinnedMemoryResource(PinnedMemoryResourceOptions(ipc_enabled=True, max_size=MAX))
    buf = mr.allocate(N, stream=dev.default_stream)
    if os.environ.get("PROBE_NOSYNC") != "1":
        dev.sync()
    ctypes.memmove(int(buf.handle), PATTERN, N)
    desc = buf.ipc_descriptor
    payload, size = desc.__reduce__()[1]
    fd = int(mr.allocation_handle)
    methods = sys.argv[1:] or [
        "cpu",
        "gpucopy",
        "memcpy",
        "sethost_cpu",
        "setdev_gpucopy",
        "sethost_memcpy",
        "ownpool_cpu",
        "ownpool_memcpy",
        "ownpool_setdev_gpucopy",
    ]
    for method in methods:
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        p = ctx.Process(target=child, args=(method, b, payload, size))
        p.start()
        socket.send_fds(a, [b"fd"], [fd])
        p.join(60)
        if p.is_alive():
            p.kill()
            p.join()
            status = "HUNG"
        elif p.exitcode != 0:
            status = f"exit {p.exitcode}"
        else:
            status = "exit 0"
        print(f"{method:16s} {status}", flush=True)
        a.close()
        b.close()
    buf.close(dev.default_stream)
    mr.close()


if __name__ == "__main__":
    main()
