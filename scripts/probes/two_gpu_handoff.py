"""Probe: which cross-GPU handoff pattern breaks the consumer's context (GPU machine, 2 GPUs).

``python3 scripts/probes/two_gpu_handoff.py``: a fresh two-worker cluster (rotated
CUDA_VISIBLE_DEVICES, device pools) per variant; prints ok or the first error.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

MiB = 1 << 20
OUT = os.environ.get("OUT", "/tmp")


def _debug_log(tag: str) -> None:
    """Worker: send dask_gpupool's DEBUG log to $OUT/<tag>-<pid>.log; dump tracebacks on a crash."""
    import faulthandler

    path = os.path.join(OUT, f"{tag}-{os.getpid()}.log")
    h = logging.FileHandler(path)
    h.setFormatter(logging.Formatter("%(asctime)s %(threadName)s %(name)s %(levelname)s %(message)s"))
    for name in ("dask_gpupool", "distributed.worker"):
        lg = logging.getLogger(name)
        lg.addHandler(h)
        lg.setLevel(logging.DEBUG)
    faulthandler.enable(open(path + ".fault", "w"))


def exporter_grants_peers(dask_worker: Any) -> str:
    """Worker: grant every other visible GPU access to this worker's own pool (in the owner's process)."""
    from cuda.core import system

    from dask_gpupool.dask.worker_plugin import service_of

    pool = service_of(dask_worker).pool
    others = {i for i in range(system.get_num_devices()) if i != pool.device}
    pool.resource.peer_accessible_by = others
    return f"pool {pool.uuid} accessible by {sorted(others)}"


def inspect_read(x: Any) -> str:
    """Worker task: where the handed-over Buffer points, which context is current, and a 1-byte read."""
    import ctypes

    from cuda.bindings import driver

    (sticky,) = driver.cuCtxSynchronize()
    err, ctx_dev = driver.cuCtxGetDevice()
    cur = int(ctx_dev) if err == driver.CUresult.CUDA_SUCCESS else f"none ({err.name})"
    ptr = int(x.handle)
    err, ordinal = driver.cuPointerGetAttribute(driver.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, ptr)
    out = ctypes.create_string_buffer(1)
    from cuda.core import Device

    Device().set_current()
    (e1,) = driver.cuMemcpy(ctypes.addressof(out), ptr, 1)
    where = f"ptr {ptr:#x} dev_id {x.device_id} ordinal {ordinal} ({err.name}) ctx-before {cur} sync {sticky.name}"
    return f"{where} read {e1.name} {out.raw!r}"


def variant(
    name: str, n: int, nbytes: int, producer: str, reader: str, env: dict[str, str] | None = None, patch: str = ""
) -> str:
    from distributed import Client, Nanny, Scheduler, SpecCluster

    from dask_gpupool import GPUPool, stats
    from dask_gpupool import testing as T

    envs = [{"CUDA_VISIBLE_DEVICES": "0,1", **(env or {})}, {"CUDA_VISIBLE_DEVICES": "1,0", **(env or {})}]
    workers = {
        f"w{i}": {"cls": Nanny, "options": {"nthreads": 1, "env": e, "silence_logs": logging.ERROR}}
        for i, e in enumerate(envs)
    }
    sched = {"cls": Scheduler, "options": {"dashboard_address": None}}
    with SpecCluster(workers=workers, scheduler=sched, silence_logs=logging.ERROR) as cl, Client(cl) as c:
        c.wait_for_workers(2)
        c.register_plugin(GPUPool(kind="device", max_size="2 GiB"))
        tag = "".join(ch if ch.isalnum() else "_" for ch in name)
        c.run(_debug_log, tag)
        if "exporter-peer" in patch:
            print(c.run(exporter_grants_peers), flush=True)
        a, b = sorted((info := T.workers(c)), key=lambda w: info[w]["name"])
        try:
            if producer == "fill":
                xs = [c.submit(T.fill, nbytes, 5, workers=[a], pure=False) for _ in range(n)]
            else:
                xs = [c.submit(T.make_buffer, nbytes, b"\x05", workers=[a], pure=False) for _ in range(n)]
            if "produced first" in name:
                c.gather(c.submit(lambda *_: None, *xs, workers=[a], pure=False))
            ys = [c.submit(T.keep, x, workers=[b], pure=False) for x in xs]
            if reader == "inspect":
                got = [c.submit(inspect_read, y, workers=[b], pure=False).result() for y in ys]
                print("\n".join(got), flush=True)
                ok = all("SUCCESS" in g.split("read ")[1] for g in got)
            elif reader == "head":
                got = c.gather([c.submit(T.head, y, 1, workers=[b], pure=False) for y in ys])
                ok = all(g == b"\x05" for g in got)
            else:
                ok = all(c.gather([c.submit(T.all_equal, y, 5, workers=[b], pure=False) for y in ys]))
            st = stats(c)[b]
            how = f"zero-copy {st['zero_copy_bytes'] >> 20} MiB, copied {st['copied_bytes'] >> 20} MiB"
            how += f" {st['fallbacks']}"
            return f"{name:40s} {'ok' if ok else 'WRONG DATA'}  ({how})"
        except Exception as e:
            return f"{name:40s} FAILED {type(e).__name__}: {str(e)[:160]}"


def main() -> None:
    no_offload = {"DASK_DISTRIBUTED__COMM__OFFLOAD": "100GiB"}
    one_conn = {
        "DASK_DISTRIBUTED__WORKER__CONNECTIONS__OUTGOING": "1",
        "DASK_DISTRIBUTED__WORKER__CONNECTIONS__INCOMING": "1",
        "DASK_DISTRIBUTED__WORKER__TRANSFER__MESSAGE_BYTES_LIMIT": "4GiB",
    }
    variants: list[tuple[Any, ...]] = [
        ("1 x make_buffer 16MiB, head", 1, 16 * MiB, "make", "head"),
        ("8 x fill 1MiB, head", 8, MiB, "fill", "head"),
        ("8 x make_buffer 16MiB, head", 8, 16 * MiB, "make", "head"),
        ("8 x make_buffer 16MiB, head, no offload", 8, 16 * MiB, "make", "head", no_offload),
        ("8 x fill 16MiB, head", 8, 16 * MiB, "fill", "head"),
        ("8 x make_buffer 16MiB, head, produced first", 8, 16 * MiB, "make", "head"),
        ("8 x make_buffer 16MiB, all_equal", 8, 16 * MiB, "make", "all_equal"),
        ("8 x make_buffer 16MiB, inspect", 8, 16 * MiB, "make", "inspect"),
        ("8 x make_buffer 16MiB, head, exporter-peer", 8, 16 * MiB, "make", "head", None, "exporter-peer"),
        ("8 x make_buffer 16MiB, head, 1conn", 8, 16 * MiB, "make", "head", one_conn),
        ("8 x fill 16MiB, all_equal", 8, 16 * MiB, "fill", "all_equal"),
        ("8 x fill 16MiB, all_equal, no offload", 8, 16 * MiB, "fill", "all_equal", no_offload),
    ]
    only = sys.argv[1:]
    for args in variants:
        if not only or any(o in args[0] for o in only):
            print(variant(*args), flush=True)


if __name__ == "__main__":
    main()
