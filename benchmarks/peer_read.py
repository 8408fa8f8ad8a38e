"""What a kernel pays for reading its operands from another GPU's memory (a zero-copy import across GPUs).

A handoff across GPUs maps the producer's memory on the consumer: every kernel that reads the value then reads it
over NVLink (or PCIe), not from the consumer's own memory. This times, on GPU 0, a matrix product and an
elementwise sum whose operand lives on GPU 1 (peer access enabled, the array labelled as GPU 0's, as an import
is) against the same operand copied into GPU 0's memory first (the copy's time reported apart), median of
``--repeats``. Needs two GPUs and CuPy. Writes JSON to ``benchmarks/results/`` (and ``$OUT``).

    python benchmarks/peer_read.py [--n 2048] [--repeats 20]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(__file__))
import handoff as H  # benchmarks/handoff.py: save_json


def timed(fn: Any, repeats: int) -> float:
    import cupy

    fn()
    cupy.cuda.Device().synchronize()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        cupy.cuda.Device().synchronize()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args()
    import cupy

    if cupy.cuda.runtime.getDeviceCount() < 2:
        raise SystemExit("needs two GPUs")
    n = args.n
    with cupy.cuda.Device(1):
        remote_b = cupy.random.rand(n, n)
    with cupy.cuda.Device(0):
        cupy.cuda.runtime.deviceEnablePeerAccess(1)
        a = cupy.random.rand(n, n)
        mem = cupy.cuda.UnownedMemory(remote_b.data.ptr, remote_b.nbytes, remote_b, device_id=0)
        peer = cupy.ndarray((n, n), dtype=remote_b.dtype, memptr=cupy.cuda.MemoryPointer(mem, 0))
        local = cupy.empty_like(a)
        rows = []
        copy_s = timed(lambda: cupy.copyto(local, peer), args.repeats)
        assert bool((local == peer).all())
        for name, fn_peer, fn_local in (
            ("matmul", lambda: a @ peer, lambda: a @ local),
            ("elementwise", lambda: a + peer, lambda: a + local),
            ("sum", lambda: peer.sum(), lambda: local.sum()),
        ):
            rows.append({"op": name, "peer_s": timed(fn_peer, args.repeats), "local_s": timed(fn_local, args.repeats)})
    result: dict[str, Any] = {"n": n, "nbytes": int(remote_b.nbytes), "copy_s": copy_s, "rows": rows}
    print(f"{n}x{n} float64 ({remote_b.nbytes >> 20} MiB) on GPU 1, read by GPU 0; median of {args.repeats}")
    print(f"copy into GPU 0's memory: {copy_s * 1e3:8.3f} ms")
    print(f"{'op':<12} {'peer ms':>9} {'local ms':>9} {'peer/local':>10}")
    for r in rows:
        print(f"{r['op']:<12} {r['peer_s'] * 1e3:9.3f} {r['local_s'] * 1e3:9.3f} {r['peer_s'] / r['local_s']:10.2f}")
    H.save_json("peer_read", result)


if __name__ == "__main__":
    main()
