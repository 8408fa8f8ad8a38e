"""Where a copy that arrives over TCP should land: pinned staging and a host-to-device copy, or vkgdr.

The pipelined copy path (values for another host over TCP, ``dask_gpupool/tuning.py``) receives each chunk into
pinned host staging and copies it into the receiver's pool with ``cuMemcpyHtoDAsync``. vkgdr maps device memory
into the host's address space through Vulkan (``HOST_VISIBLE | DEVICE_LOCAL``), so ``recv_into`` can write the
bytes straight into GPU memory. This compares the two on one machine, over a loopback TCP connection from a sender
thread that streams ``--size`` bytes in ``--chunk`` chunks:

- ``pinned``: ``recv_into`` two pinned staging chunks in turn; each full chunk copied to the device buffer on a
  stream while the next is received (the copy path's scheme);
- ``vkgdr``: ``recv_into`` the vkgdr mapping itself (flushed when not coherent), then, as ``vkgdr+pool``, one
  device-to-device copy into an ordinary device buffer (a pool buffer in the real path, since vkgdr memory is not
  in the worker's IPC pool).

Each is timed from the first byte requested to the data usable on the GPU, median of ``--repeats``, and checked
(a checksum of the device bytes against the sender's). vkgdr needs the Vulkan loader (``libvulkan.so.1``) and
the ``vkgdr`` and ``cffi`` wheels; without them the script says exactly what failed. JSON to
``benchmarks/results/`` (and ``$OUT``).

    python benchmarks/vkgdr_landing.py [--size 1GiB] [--chunk 16MiB] [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import threading
import time
from typing import Any

from dask.utils import format_bytes, parse_bytes

sys.path.insert(0, os.path.dirname(__file__))
import handoff as H  # benchmarks/handoff.py: save_json


def sender(listener: socket.socket, payload: memoryview, times: int) -> None:
    """Serve ``payload`` ``times`` times, one connection each."""
    for _ in range(times):
        conn, _ = listener.accept()
        with conn:
            conn.sendall(payload)


def receive(port: int, total: int, into: Any, chunk: int, land: Any = None) -> None:
    """Receive ``total`` bytes in ``chunk`` pieces: straight into ``into`` (``land`` None), or each piece into
    alternating halves of ``into`` (two chunks of staging), then ``land(i, offset, n)``."""
    view = memoryview(into).cast("B")
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        done, i = 0, 0
        while done < total:
            n = min(chunk, total - done)
            part = view[done : done + n] if land is None else view[(i % 2) * chunk : (i % 2) * chunk + n]
            got = 0
            while got < n:
                r = s.recv_into(part[got:], n - got)
                if not r:
                    raise ConnectionError("sender closed early")
                got += r
            if land is not None:
                land(i, done, n)
            done += n
            i += 1


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="1GiB")
    p.add_argument("--chunk", default="16MiB")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    size, chunk = int(parse_bytes(args.size)), int(parse_bytes(args.chunk))
    import cupy
    import numpy as np

    cupy.cuda.Device(0).use()
    payload = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8)
    expected = int(payload[::4096].astype(np.uint64).sum())
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    port = listener.getsockname()[1]
    methods: dict[str, Any] = {}

    # -- pinned staging + host-to-device copies, double-buffered
    dest = cupy.empty(size, dtype=cupy.uint8)
    staging = cupy.cuda.alloc_pinned_memory(2 * chunk)
    host = np.frombuffer(staging, dtype=np.uint8, count=2 * chunk)
    stream = cupy.cuda.Stream(non_blocking=True)
    copied = [cupy.cuda.Event(), cupy.cuda.Event()]

    def pinned() -> None:
        def land(i: int, offset: int, n: int) -> None:
            slot = i % 2
            dest[offset : offset + n].set(host[slot * chunk : slot * chunk + n], stream=stream)
            copied[slot].record(stream)
            copied[1 - slot].synchronize()  # the other slot is free again before it is received into

        for e in copied:
            e.record(stream)
        receive(port, size, host, chunk, land)
        stream.synchronize()

    methods["pinned"] = (pinned, lambda: dest)

    # -- vkgdr: straight into device memory
    vk_error = None
    try:
        import vkgdr
        from cuda.core import Device

        Device(0).set_current()  # vkgdr opens the current CUDA context
        handle = vkgdr.Vkgdr.open_current_context()
        mem = vkgdr.RawMemory(handle, size)
        mapped = np.asarray(mem).view(np.uint8)
        on_gpu = cupy.ndarray(
            (size,),
            dtype=cupy.uint8,
            memptr=cupy.cuda.MemoryPointer(cupy.cuda.UnownedMemory(mem.device_ptr, size, mem), 0),
        )
        coherent, atom = mem.is_coherent, mem.non_coherent_atom_size

        def vk() -> None:
            receive(port, size, mapped, chunk)
            if not coherent:
                mem.flush(0, size)

        pool_dest = cupy.empty(size, dtype=cupy.uint8)

        def vk_pool() -> None:
            vk()
            pool_dest[...] = on_gpu
            cupy.cuda.Device().synchronize()

        methods["vkgdr"] = (vk, lambda: on_gpu)
        methods["vkgdr+pool"] = (vk_pool, lambda: pool_dest)
    except Exception as e:  # no loader, no wheel, no HOST_VISIBLE device heap: say which
        vk_error = f"{type(e).__name__}: {e}"
        coherent, atom = None, None
    runs = len(methods) * (args.repeats + 1)
    threading.Thread(target=sender, args=(listener, memoryview(payload), runs), daemon=True).start()
    rows = []
    for name, (fn, result) in methods.items():
        samples = []
        for k in range(args.repeats + 1):
            t0 = time.perf_counter()
            fn()
            cupy.cuda.Device().synchronize()
            if k:
                samples.append(time.perf_counter() - t0)
        ok = int(result()[::4096].astype(cupy.uint64).sum()) == expected
        med = statistics.median(samples)
        rows.append({"method": name, "median_s": med, "gb_s": size / med / 1e9, "correct": ok})
    print(f"{format_bytes(size)} over loopback TCP in {format_bytes(chunk)} chunks, median of {args.repeats}")
    if vk_error:
        print(f"vkgdr: not available: {vk_error}")
    else:
        print(f"vkgdr: coherent {coherent}, non-coherent atom {atom}")
    for r in rows:
        right = "right" if r["correct"] else "WRONG"
        print(f"{r['method']:<12} {r['median_s'] * 1e3:9.1f} ms  {r['gb_s']:6.2f} GB/s  bytes {right}")
    H.save_json("vkgdr_landing", {"size": size, "chunk": chunk, "vkgdr_error": vk_error, "rows": rows})


if __name__ == "__main__":
    main()
