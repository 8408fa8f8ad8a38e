"""What an importer reads after its exporter process dies: pool IPC vs. CUDA VMM handles.

Three processes, no Dask: an exporter on GPU ``e`` makes 64 MiB, sets every byte
to 7 and sends its file descriptor over a Unix socket (SCM_RIGHTS); an importer
on GPU ``i`` maps it and checks it; then the exporter is SIGKILLed and reaped,
the importer reads again, a scribbler process fills all free memory of GPU
``e`` with 0x55, and the importer reads a third time. Each read reports
``ok`` (all 7), ``changed`` (other bytes: the memory was freed and reused) or
the CUDA error (``CUDA_ERROR_CONTAINED`` kills the importer's context).

Mechanisms:

- ``pool``: cuda.core ``DeviceMemoryResource(ipc_enabled=True)``, the
  allocation imported with ``Buffer.from_ipc_descriptor`` (the memory
  ``device`` pools do not place buffers in, for what this shows);
- ``vmm``: ``cuMemCreate`` with a POSIX-fd handle, imported with
  ``cuMemImportFromShareableHandle`` and mapped with ``cuMemMap`` /
  ``cuMemSetAccess`` (the importer holds its own reference to the physical
  memory); both through dask_gpupool's own :mod:`dask_gpupool.memory.vmm` classes.

    python benchmarks/exporter_death.py      # every mechanism x placement the GPUs allow
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import platform
import signal
import socket
import sys
import tempfile
import time
from typing import Any

SIZE = 64 << 20
FILL, SCRIBBLE = 7, 0x55


def _check(err: Any, what: str) -> None:
    from cuda.bindings import driver

    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"{what}: {err!r}")


def exporter(path: str, mechanism: str, ordinal: int) -> None:
    from cuda.bindings import driver
    from cuda.core import Device

    dev = Device(ordinal)
    dev.set_current()
    if mechanism == "pool":
        from cuda.core import DeviceMemoryResource, DeviceMemoryResourceOptions

        mr = DeviceMemoryResource(dev, DeviceMemoryResourceOptions(ipc_enabled=True, max_size=1 << 30))
        buf = mr.allocate(SIZE, stream=dev.default_stream)
        ptr = int(buf.handle)
        fd = int(mr.allocation_handle)
        _, (payload, _size) = buf.ipc_descriptor.__reduce__()
    else:  # what device pools' segments are made of (dask_gpupool.memory.vmm)
        from dask_gpupool.memory.vmm import VmmMemoryResource

        vmm = VmmMemoryResource(ordinal, 1 << 30)
        buf = vmm.allocate(SIZE)
        ptr = int(buf.handle)
        fd = vmm.export_fd(ptr)
        payload = b""
    (err,) = driver.cuMemsetD8(ptr, FILL, SIZE)
    _check(err, "cuMemsetD8")
    dev.sync()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as srv:
        srv.bind(path)
        srv.listen(1)
        conn, _ = srv.accept()
        socket.send_fds(conn, [payload or b"-"], [fd])
        conn.close()
    time.sleep(3600)  # until SIGKILLed


def importer(conn: Any, path: str, mechanism: str, owner: int, ordinal: int) -> None:
    from cuda.core import Buffer, Device

    dev = Device(ordinal)
    dev.set_current()
    import cupy

    for _ in range(200):
        if os.path.exists(path):
            break
        time.sleep(0.05)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(path)
        msg, fds, _, _ = socket.recv_fds(s, 256, 1)
    fd = fds[0]
    if mechanism == "pool":
        from cuda.core import DeviceMemoryResource
        from cuda.core._memory._ipc import IPCBufferDescriptor

        mr = DeviceMemoryResource.from_allocation_handle(owner, fd)
        os.close(fd)
        if owner != ordinal:
            mr.peer_accessible_by = {ordinal}
        buf = Buffer.from_ipc_descriptor(mr, IPCBufferDescriptor._init(msg, SIZE), stream=dev.default_stream)
        ptr = int(buf.handle)
    else:
        from dask_gpupool.memory.vmm import VmmMapping

        mapping = VmmMapping.open(fd, SIZE, ordinal)  # its own reference to the memory
        os.close(fd)
        ptr = mapping.handle
    mem = cupy.cuda.UnownedMemory(ptr, SIZE, None, device_id=ordinal)
    arr = cupy.ndarray((SIZE,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(mem, 0))
    while True:
        cmd = conn.recv()
        if cmd == "quit":
            break
        try:
            good = int((arr == FILL).sum())
            conn.send("ok" if good == SIZE else f"changed ({SIZE - good} of {SIZE} bytes differ)")
        except Exception as e:
            conn.send(f"{type(e).__name__}: {e}")
            break


def scribbler(ordinal: int) -> None:
    import cupy

    with cupy.cuda.Device(ordinal):
        free, _ = cupy.cuda.runtime.memGetInfo()
        blocks = []
        chunk = 1 << 30
        while free > (256 << 20):
            n = min(chunk, free - (256 << 20))
            try:
                blocks.append(cupy.full((n,), SCRIBBLE, dtype=cupy.uint8))
            except cupy.cuda.memory.OutOfMemoryError:
                chunk //= 2
                if chunk < (64 << 20):
                    break
                continue
            free, _ = cupy.cuda.runtime.memGetInfo()
        cupy.cuda.Device(ordinal).synchronize()


def case(mechanism: str, owner: int, ordinal: int) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "fd.sock")
        ex = ctx.Process(target=exporter, args=(path, mechanism, owner), daemon=True)
        ex.start()
        parent, child = ctx.Pipe()
        im = ctx.Process(target=importer, args=(child, path, mechanism, owner, ordinal), daemon=True)
        im.start()
        reads: dict[str, str] = {}

        def read(when: str) -> None:
            if not im.is_alive():
                reads[when] = "importer exited"
                return
            parent.send("read")
            reads[when] = parent.recv() if parent.poll(60) else "no answer in 60 s"

        read("exporter alive")
        os.kill(ex.pid, signal.SIGKILL)
        ex.join()
        time.sleep(2)
        read("after exporter SIGKILL")
        sc = ctx.Process(target=scribbler, args=(owner,))
        sc.start()
        sc.join()
        read("after another process filled the exporter GPU")
        if im.is_alive():
            parent.send("quit")
        im.join(30)
        if im.is_alive():
            im.kill()
    return {"mechanism": mechanism, "exporter_gpu": owner, "importer_gpu": ordinal, "reads": reads}


def main() -> None:
    from cuda.core import system

    n = system.get_num_devices() if hasattr(system, "get_num_devices") else system.num_devices
    placements = [(0, 0)] + ([(0, 1)] if n > 1 else [])
    results = [case(m, e, i) for m in os.environ.get("MECHANISMS", "pool vmm").split() for e, i in placements]
    for r in results:
        print(json.dumps(r))
    print(f"\n{'mechanism':<6} {'placement':<10} {'exporter alive':<16} {'after SIGKILL':<30} after reuse of its GPU")
    for r in results:
        place = "same GPU" if r["exporter_gpu"] == r["importer_gpu"] else "across"
        v = list(r["reads"].values()) + ["-"] * 3
        print(f"{r['mechanism']:<6} {place:<10} {v[0]:<16} {v[1][:30]:<30} {v[2][:60]}")
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "exporter_death.json"), "w") as f:
            json.dump({"host": platform.node(), "results": results}, f, indent=1)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
