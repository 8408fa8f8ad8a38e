"""Every pair of a four-worker, two-"host" UCX cluster: Dask UCXX alone against dask_gpupool over UCXX.

Four workers on one machine with two GPUs, ``gpupool.host-id`` set so that they look like two hosts of two GPUs each
(w0, w1 on "host-a"; w2, w3 on "host-b"; w0 and w2 on GPU 0, w1 and w3 on GPU 1). For every ordered pair a float64
CuPy array of each ``--sizes`` is made on the first worker and consumed by a task pinned to the second; the consumer's
transfer time is ``stop - start`` of its transfer log entry, median of ``--repeats`` after a warm-up. Methods:
``ucxx`` (plain CuPy, no plugin), ``ucxx+gpupool`` (the plugin at its defaults, an array over a pool buffer)
and ``ucxx+gpupool-unstaged`` (``dask_gpupool.tuning.UCX_STAGING_THRESHOLD`` set above every size
in the workers: pool memory goes to UCX as it is, for UCX's own small-message protocol, instead of staged first);
``ucxx+gpupool-plain`` (the plugin and a plain CuPy array: what the plugin
costs on Dask's own path);
``ucxx+gpupool-ab`` (one cluster, every sample taken with pool memory staged and unstaged back to back, so that the
two are compared at the same moment: rows ``ucxx+gpupool-ab:staged`` and ``-ab:unstaged``);
``ucxx+gpupool-hooks-ab`` (one cluster, the plugin with plain CuPy arrays, every sample taken with the plugin's
``get_data`` wrapper and CuPy serializers in place and with distributed's own put back, back to back: what the
plugin's hooks cost a transfer it does not change); ``ucxx+gpupool-pool-ab`` (one cluster, the plugin at its
defaults, every sample taken with an array over a pool buffer and with a CuPy array outside every pool, back to
back: what pool memory costs a pair that gets device frames); ``ucxx+gpupool-hooks-parts`` (as ``-hooks-ab``, with
two more variants: only the ``get_data`` wrapper put back to distributed's, only the serializers);
``ucxx+gpupool-alone-ab`` (one cluster, every sample taken both ways back to back: ``:plugin``, an array over a
pool buffer with the plugin's hooks, and ``:alone``, a CuPy array from CuPy's own pool with distributed's
``get_data`` and serializers put back, which is UCXX alone's path in the same workers at the same moment: the
per-pair comparison without the 15-25% that separate two clusters);
``ucxx+gpupool-hostframes-ab`` and ``ucxx+gpupool-plain-hostframes-ab`` (one cluster, pool arrays or plain ones,
every sample taken with every size sent as one host frame (``dask_gpupool.tuning.UCX_HOST_FRAME_THRESHOLD`` above
it) and as device frames (the threshold 0), back to back); ``ucxx+gpupool-hostalone-ab`` and
``ucxx+gpupool-plain-hostalone-ab`` (the same host frames against UCXX alone's path, as ``-alone-ab``);
``ucxx+gpupool-inline-ab`` (one cluster, pool arrays, every sample taken with the plugin's inline replies on and off,
back to back: rows ``:inline``, a UCX reply of a few device values serialized on the event
loop with its staging copy left to distributed-ucxx's synchronize, and ``:offloaded``, Dask's offload thread over
10 MiB and the staging copy waited for) and ``ucxx+gpupool-plain-inline-ab`` (the same with plain CuPy arrays).
``ucxx+gpupool-region-ab`` (an experiment, one cluster, the plugin at its defaults: every sample taken with a CuPy
array at a new offset of one allocation from CuPy's own pool, ``:rotating``, and at the same offset, ``:fixed``, back
to back: what a send from a new address inside an allocation UCX already exported costs; ``-pool-ab`` and
``-region-ab`` rows say how many distinct addresses each cell sent); ``ucxx+gpupool-driver-ab`` (an experiment, as
``-region-ab``: a CuPy array at the start of one 1 GiB ``cuMemAlloc`` allocation made through ``cuda.bindings``
outside every pool, ``:driver``, against one from CuPy's own pool, ``:plain``: both plain arrays to the plugin, so
only the memory differs).
``ucxx+gpupool-recvrmm-ab`` (an experiment, one cluster, pool arrays: every sample taken four ways back to back,
the plugin with distributed-ucxx receiving device frames into ``rmm.DeviceBuffer`` from an RMM pool over
``cudaMalloc`` (``:rmmpool``), from RMM's ``cudaMallocAsync`` resource (``:rmmasync``), from RMM's current resource
as UCXX does (``:cudamalloc``: ``cudaMalloc`` per frame), and UCXX alone's path (``:alone``)). Every ``:alone``
variant receives as distributed-ucxx does by itself, not into the plugin's UCX receive pool.
``-legacy`` anywhere after ``gpupool`` (``ucxx+gpupool-legacy``, ``ucxx+gpupool-legacy-alone-ab``) gives the pools
segments of legacy IPC memory (``gpupool.segment-memory: legacy``), which UCX sends to another "host" without the
staging copy (``auto`` makes those on UCX workers), and ``-vmm``
(``ucxx+gpupool-vmm-alone-ab``) gives them VMM segments, whose memory is staged for another "host".
For pool arrays a same-"host" pair gets a descriptor (zero-copy), another-"host" pair the value's device frames,
which UCX moves GPU to GPU. After each method the table of bytes by path (zero-copy, device frames, host copies)
shows that no pair went through the host (``--proto-info`` has UCX print the protocols it picked, which says what
UCX itself did). Needs distributed-ucxx. On a machine with one GPU all four workers share GPU 0 (the same two
"hosts"): every pair is then a same-GPU pair, which says nothing about pairs across GPUs.
JSON to ``benchmarks/results/`` (and ``$OUT``), written again after each method, so that a run cut off by its time
limit keeps the methods it finished. After each ``-ab`` method, and in the JSON (``ab``): every variant but the last
against the last, the mean over pairs of each pair's ratio and difference, and the pairs at or below it. The
``-ab`` variants that measure another size of a :mod:`dask_gpupool.tuning` constant set it as a module attribute in
the workers' processes (``client.run``), where the serializers read it at each value.

    python benchmarks/ucx_pairs.py [--sizes 4KiB,1MiB,16MiB,256MiB] [--repeats 5] [--reverse] [--pairs 2:0,0:2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

from dask.utils import format_bytes, parse_bytes
from distributed import wait

sys.path.insert(0, os.path.dirname(__file__))
import handoff as H  # benchmarks/handoff.py: its cluster, produce/consume and between_samples

from dask_gpupool import GPUPool
from dask_gpupool import testing as T
from dask_gpupool.memory.topology import local_devices

#: The four workers: (host id, CUDA_VISIBLE_DEVICES).
LAYOUT = [("host-a", "0,1"), ("host-a", "1,0"), ("host-b", "0,1"), ("host-b", "1,0")]
#: The same two "hosts" on a machine with one GPU.
ONE_GPU_LAYOUT = [("host-a", "0"), ("host-a", "0"), ("host-b", "0"), ("host-b", "0")]
#: Methods whose arrays are plain CuPy, not pool arrays.
PLAIN_METHODS = (
    "-plain",
    "-hooks-ab",
    "-hooks-parts",
    "-plain-inline-ab",
    "-plain-hostframes-ab",
    "-plain-hostalone-ab",
)
PATH_KEYS = (
    "zero_copy_bytes",
    "device_frames_bytes",
    "receive_pooled_bytes",  # the part of device_frames_bytes received into the UCX receive pool
    "host_frames_bytes",
    "copied_bytes",
)


def _set_tuning(**values: int) -> None:
    """On a worker: constants of :mod:`dask_gpupool.tuning` set in this process, where the serializers read them at
    each value (the ``-ab`` methods' switch)."""
    from dask_gpupool import tuning

    for name, value in values.items():
        setattr(tuning, name, value)


def _set_staging_threshold(nbytes: int) -> None:
    """On a worker: ``dask_gpupool.tuning.UCX_STAGING_THRESHOLD`` (the ``-ab`` methods' switch)."""
    _set_tuning(UCX_STAGING_THRESHOLD=nbytes)


def _set_hooks(off: list[str], dask_worker: Any = None) -> None:
    """On a worker: the plugin's hooks named in ``off`` replaced by distributed's own, the others in place (the
    ``-hooks-ab`` and ``-hooks-parts`` switch). ``"get_data"``: the ``get_data`` wrapper; ``"serializers"``: the CuPy
    serializers (both directions, both families). The comms the worker reads from keep their read wrapper, which does
    nothing more than open an empty collector when no copy is deferred. The plugin's are kept on the worker object
    meanwhile (this function travels by value: a module global would be a new dict at each call)."""
    from distributed.protocol.cuda import cuda_deserialize, cuda_serialize
    from distributed.protocol.serialize import dask_deserialize, dask_serialize

    try:
        import cupy
        from distributed.protocol import cupy as distributed_cupy
    except ImportError:  # no CuPy (a CPU smoke run): only the get_data wrapper to switch
        registries = {}
    else:
        registries = {
            "cuda_serialize": (cuda_serialize, distributed_cupy.cuda_serialize_cupy_ndarray),
            "cuda_deserialize": (cuda_deserialize, distributed_cupy.cuda_deserialize_cupy_ndarray),
            "dask_serialize": (dask_serialize, distributed_cupy.dask_serialize_cupy_ndarray),
            "dask_deserialize": (dask_deserialize, distributed_cupy.dask_deserialize_cupy_ndarray),
        }
    saved = dask_worker.__dict__.setdefault("_bench_saved_hooks", {})
    if "get_data" in saved and "get_data" not in off:
        dask_worker.handlers["get_data"] = saved.pop("get_data")
    elif "get_data" in off and "get_data" not in saved:
        saved["get_data"] = dask_worker.handlers["get_data"]
        dask_worker.handlers["get_data"] = saved["get_data"].__wrapped__
    for name, (registry, own) in registries.items():
        if name in saved and "serializers" not in off:
            registry.register(cupy.ndarray)(saved.pop(name))
        elif "serializers" in off and name not in saved:
            saved[name] = registry.dispatch(cupy.ndarray)
            registry.register(cupy.ndarray)(own)


def _set_inline(on: bool) -> None:
    """On a worker: the ``-inline-ab`` switch. On: the plugin as it is (a UCX reply of a few device values
    serialized on the event loop, a staging copy left to distributed-ucxx's synchronize; over TCP, replies of CuPy
    arrays staged into the pool too). Off: Dask's offload thread for replies over 10 MiB, unless all descriptors of
    pool memory; every staging copy for UCX waited for. Both sides build a staged array's header directly."""
    from dask_gpupool.dask import cuda_family, replies, ucx_host_frames

    saved = replies.__dict__.setdefault("_bench_inline", (replies.INLINE_MAX_VALUES, cuda_family.SYNCHRONIZING_SCHEMES))
    replies.INLINE_MAX_VALUES = saved[0] if on else 0
    cuda_family.SYNCHRONIZING_SCHEMES = ucx_host_frames.SYNCHRONIZING_SCHEMES = saved[1] if on else frozenset()


def _set_host_frames(below: int) -> None:
    """On a worker: the ``-hostframes-ab`` switch, ``dask_gpupool.tuning.UCX_HOST_FRAME_THRESHOLD`` (CuPy arrays
    under ``below`` bytes in a UCX reply go as a host frame; 0: none, device frames)."""
    _set_tuning(UCX_HOST_FRAME_THRESHOLD=below)


def _set_receive(mode: str) -> None:
    """On a worker: where distributed-ucxx receives device frames (its module's ``device_array``), the ``-alone-ab``
    methods' and the ``-recvalone-ab`` and ``-recvrmm-ab`` experiments' switch. ``"plugin"``: as the plugin set it
    (:mod:`dask_gpupool.dask.ucx_receive`); ``"default"``: distributed-ucxx's own ``rmm.DeviceBuffer`` from RMM's
    current resource (``cudaMalloc`` and ``cudaFree`` per frame on a plain worker), as UCXX alone; ``"pool"``:
    buffers of the worker's gpupool pool; ``"rmm-pool"``: ``rmm.DeviceBuffer`` from an RMM pool over ``cudaMalloc``
    made once per worker (what ``distributed.rmm.pool-size`` gives UCXX); ``"rmm-async"``: from an RMM
    ``cudaMallocAsync`` resource made once per worker."""
    import distributed_ucxx.ucxx as comm

    from dask_gpupool.dask.cuda_family import _DeviceFrame
    from dask_gpupool.dask.ucx_receive import ReceivePool
    from dask_gpupool.handoff.registry import active_service

    saved = comm.__dict__.setdefault("_bench_device_array", comm.device_array)  # the plugin's, if it installed one
    pool = getattr(saved, "__self__", None)
    own = pool.fallback if isinstance(pool, ReceivePool) else saved  # distributed-ucxx's own
    service = active_service()
    if mode == "plugin":
        comm.device_array = saved
        return
    if mode == "default" or (mode == "pool" and service is None):
        comm.device_array = own
        return
    if mode == "pool":

        def device_array(n: int) -> Any:
            buf = service.pool.allocate(n)
            return _DeviceFrame(int(buf.handle), n, buf)

        comm.device_array = device_array
        return
    import rmm

    resources = comm.__dict__.setdefault("_bench_receive_resources", {})  # made once per worker process
    if mode not in resources:
        if mode == "rmm-pool":
            resources[mode] = rmm.mr.PoolMemoryResource(rmm.mr.CudaMemoryResource(), initial_pool_size=256 << 20)
        elif mode == "rmm-async":
            resources[mode] = rmm.mr.CudaAsyncMemoryResource()
        else:
            raise ValueError(f"unknown receive mode {mode!r}")
    mr = resources[mode]

    def rmm_device_array(n: int) -> Any:
        return rmm.DeviceBuffer(size=n, mr=mr)

    comm.device_array = rmm_device_array


def _produce_outside_pools(nbytes: int) -> Any:
    """A float64 CuPy array of ``nbytes`` from CuPy's own memory pool, whatever allocator the plugin installed."""
    import cupy

    with cupy.cuda.using_allocator(cupy.get_default_memory_pool().malloc):
        arr = cupy.ones(max(nbytes // 8, 1), dtype="f8")
    cupy.cuda.runtime.deviceSynchronize()
    return arr


#: ``-region-ab``: slots of one CuPy allocation that the ``rotating`` side cycles through (the ``fixed`` side reuses
#: slot 0).
REGION_SLOTS = 32


def _produce_in_one_allocation(nbytes: int, rotate: bool) -> Any:
    """A float64 CuPy array of ``nbytes``, a view of one allocation from CuPy's own pool made once per size on this
    worker: at a new offset each call (``rotate``, cycling through :data:`REGION_SLOTS` slots) or always at offset 0.
    The ``-region-ab`` experiment: what a send from a new address inside one already exported allocation costs UCX
    (pool buffers of one segment can sit at new offsets)."""
    import cupy
    from distributed import get_worker

    regions = get_worker().__dict__.setdefault("_bench_regions", {})
    stride = -(-max(nbytes, 1) // (2 << 20)) * (2 << 20)
    if nbytes not in regions:
        with cupy.cuda.using_allocator(cupy.get_default_memory_pool().malloc):
            regions[nbytes] = [cupy.empty(stride * REGION_SLOTS, dtype="u1"), 0]
    base, calls = regions[nbytes]
    regions[nbytes][1] = calls + 1
    offset = (calls % REGION_SLOTS if rotate else 0) * stride
    arr = base[offset : offset + max(nbytes // 8, 1) * 8].view("f8")
    arr[...] = 1.0
    cupy.cuda.runtime.deviceSynchronize()
    return arr


def _produce_in_driver_allocation(nbytes: int) -> Any:
    """A float64 CuPy array of ``nbytes`` at the start of one 1 GiB ``cuMemAlloc`` allocation made once on this
    worker through ``cuda.bindings`` (as the plugin's legacy segments are made), outside every pool: the
    ``-driver-ab`` experiment, whose other side is CuPy's own memory. The plugin takes it for a plain CuPy array, so
    both sides go the same way through the plugin's code and only the memory differs."""
    import cupy
    from cuda.bindings import driver
    from distributed import get_worker

    worker = get_worker()
    with cupy.cuda.Device(0):
        cupy.cuda.runtime.free(0)  # the runtime's (primary) context made current in this thread
        if "_bench_driver_allocation" not in worker.__dict__:
            err, ptr = driver.cuMemAlloc(1 << 30)
            if err != driver.CUresult.CUDA_SUCCESS:
                raise RuntimeError(f"cuMemAlloc: {err}")
            worker._bench_driver_allocation = int(ptr)  # kept for the worker's life
        mem = cupy.cuda.UnownedMemory(worker._bench_driver_allocation, 1 << 30, worker, device_id=0)
        arr = cupy.ndarray((max(nbytes // 8, 1),), "f8", cupy.cuda.MemoryPointer(mem, 0))
        arr[...] = 1.0
        cupy.cuda.runtime.deviceSynchronize()
    return arr


def _thirds(samples: list[float]) -> str:
    """With 12 samples or more, the medians of their first, middle and last thirds in order (ms): does a pair's
    time drift over its samples?"""
    n = len(samples) // 3
    if n < 4:
        return ""
    parts = [samples[:n], samples[n:-n], samples[-n:]]
    return "; thirds " + " / ".join(f"{statistics.median(p) * 1e3:.2f}" for p in parts)


def _gc_state() -> dict[str, Any]:
    """This worker's garbage collector: objects it tracks, collections per generation so far, and the seconds of
    the full collection it runs now (what a collection costs with the objects the run has left behind)."""
    import gc

    objects = len(gc.get_objects())
    collections = [s["collections"] for s in gc.get_stats()]
    start = time.perf_counter()
    gc.collect()
    return {"objects": objects, "collections": collections, "full_collect_s": time.perf_counter() - start}


def _address(x: Any) -> int:
    """The device address of a CuPy array (``-pool-ab``, ``-region-ab`` and ``-driver-ab`` count the distinct ones
    per cell)."""
    return int(x.data.ptr)


def ab_summary(rows: list[dict[str, Any]], method: str, variants: list[str], run: int = 0) -> list[dict[str, Any]]:
    """For an ``-ab`` method's rows of cluster ``run`` (a method named twice in ``--methods`` is two clusters, each
    summed up on its own): each variant but the last against the last, per same/other "host" and size.

    The mean over the pairs of each pair's ratio and difference of medians (this variant over and minus the last),
    and how many pairs were at or below it.
    """
    base = variants[-1]
    rows = [r for r in rows if r.get("run", 0) == run]
    by = {(r["method"], r["src"], r["dst"], r["nbytes"]): r for r in rows}
    out = []
    for v in variants[:-1]:
        for same in (True, False):
            for nbytes in sorted({r["nbytes"] for r in rows if r["method"] == f"{method}:{v}"}):
                pairs = []
                for r in rows:
                    if r["method"] != f"{method}:{v}" or r["nbytes"] != nbytes or r["same_host"] != same:
                        continue
                    other = by.get((f"{method}:{base}", r["src"], r["dst"], nbytes))
                    if other is not None and r["transfer_s"] and other["transfer_s"]:
                        pairs.append((r["transfer_s"], other["transfer_s"]))
                if pairs:
                    out.append(
                        {
                            "method": method,
                            "run": run,
                            "variant": v,
                            "against": base,
                            "same_host": same,
                            "nbytes": nbytes,
                            "pairs": len(pairs),
                            "ratio": statistics.mean(a / b for a, b in pairs),
                            "diff_s": statistics.mean(a - b for a, b in pairs),
                            "at_or_below": sum(1 for a, b in pairs if a <= b),
                        }
                    )
    return out


def _print_ab(summary: list[dict[str, Any]]) -> None:
    for s in summary:
        print(
            f'  {s["variant"]} vs {s["against"]}, {"same" if s["same_host"] else "other"} "host" '
            f"{format_bytes(s['nbytes']):>10}: ratio {s['ratio']:.3f}, {s['diff_s'] * 1e3:+.3f} ms, "
            f"{s['at_or_below']} of {s['pairs']} pairs at or below",
            flush=True,
        )


def _variants(method: str, max_bytes: int) -> list[tuple[str, dict[str, Any]]]:
    """The settings each sample is taken with: one unnamed variant, or the two of an ``-ab`` method (one cluster,
    all back to back, the order alternating)."""
    if method.endswith("-hooks-ab"):
        return [("hooks", {"off": []}), ("nohooks", {"off": ["get_data", "serializers"]})]
    if method.endswith("-hooks-parts"):
        return [
            ("hooks", {"off": []}),
            ("no-get-data-hook", {"off": ["get_data"]}),
            ("no-serializers", {"off": ["serializers"]}),
            ("nohooks", {"off": ["get_data", "serializers"]}),
        ]
    if method.endswith("-recvalone-ab"):
        alone = {"off": ["get_data", "serializers"], "outside": True, "receive": "default"}
        return [("recvpool", {"off": [], "receive": "pool"}), ("alone", alone)]
    if method.endswith("-recvrmm-ab"):
        alone = {"off": ["get_data", "serializers"], "outside": True, "receive": "default"}
        return [
            ("rmmpool", {"off": [], "receive": "rmm-pool"}),
            ("rmmasync", {"off": [], "receive": "rmm-async"}),
            ("cudamalloc", {"off": [], "receive": "default"}),
            ("alone", alone),
        ]
    if method.endswith("-plain-hostalone-ab"):
        alone = {"off": ["get_data", "serializers"], "host_below": 0, "receive": "default"}
        return [("hostframes", {"off": [], "host_below": 2 * max_bytes, "receive": "plugin"}), ("alone", alone)]
    if method.endswith("-hostalone-ab"):
        alone = {"off": ["get_data", "serializers"], "outside": True, "host_below": 0, "receive": "default"}
        return [("hostframes", {"off": [], "host_below": 2 * max_bytes, "receive": "plugin"}), ("alone", alone)]
    if method.endswith("-hostframes-ab"):
        return [("hostframes", {"host_below": 2 * max_bytes}), ("deviceframes", {"host_below": 0})]
    if method.endswith("-inline-ab"):
        return [("inline", {"inline": True}), ("offloaded", {"inline": False})]
    if method.endswith("-driver-ab"):
        return [("driver", {"driver": True}), ("plain", {"outside": True})]
    if method.endswith("-region-ab"):
        return [("rotating", {"region": True}), ("fixed", {"region": False})]
    if method.endswith("-pool-ab"):
        return [("pool", {}), ("plain", {"outside": True})]
    if method.endswith("-alone-ab"):
        alone = {"off": ["get_data", "serializers"], "outside": True, "receive": "default"}
        return [("plugin", {"off": [], "receive": "plugin"}), ("alone", alone)]
    if method.endswith("-ab"):
        return [("staged", {"threshold": 0}), ("unstaged", {"threshold": 2 * max_bytes})]
    return [("", {})]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="4KiB,1MiB,16MiB,256MiB")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--methods", default="ucxx,ucxx+gpupool")
    p.add_argument(
        "--proto-info", action="store_true", help="UCX_PROTO_INFO=y in the workers: UCX prints the protocols it picks"
    )
    p.add_argument(
        "--reverse",
        action="store_true",
        help="take the pairs in reverse order (w3's first): does a pair's result depend on when it is taken?",
    )
    p.add_argument(
        "--pairs",
        default="",
        help="only these ordered pairs, by worker index: '2:0,0:2' (default every pair); with a large --repeats, "
        "each sample's time in order is in the JSON rows' 'samples'",
    )
    args = p.parse_args()
    only = {tuple(int(w) for w in pair.split(":")) for pair in args.pairs.split(",") if pair}
    n_gpus = len(local_devices().uuids)
    if n_gpus < 1:
        raise SystemExit("needs a GPU")
    layout = LAYOUT if n_gpus >= 2 else ONE_GPU_LAYOUT
    if n_gpus < 2:
        print("one GPU: all four workers on GPU 0 (two 'hosts' of two workers each)", flush=True)
    try:
        import distributed_ucxx  # noqa: F401
    except ImportError:
        raise SystemExit("needs distributed-ucxx") from None
    sizes = [int(parse_bytes(s)) for s in args.sizes.split(",")]
    workers = [
        {
            "env": {"CUDA_VISIBLE_DEVICES": gpus, **({"UCX_PROTO_INFO": "y"} if args.proto_info else {})},
            "config": {"gpupool": {"host-id": host}},
        }
        for host, gpus in layout
    ]
    names = [f"w{i}({host[-1]}{gpus[0]})" for i, (host, gpus) in enumerate(layout)]
    rows: list[dict[str, Any]] = []
    summary: list[dict[str, Any]] = []
    stamp = time.strftime("%Y%m%d-%H%M%S")  # one JSON, written again after each method (a run cut off keeps those)
    paths: dict[str, dict[str, dict[str, int]]] = {}
    timings: dict[str, dict[str, dict[str, Any]]] = {}
    gcs: dict[str, dict[str, dict[str, Any]]] = {}  # each worker's garbage collector at a method's start and end
    for run, method in enumerate(args.methods.split(",")):
        plugin = (
            GPUPool(
                kind="device",
                max_size=f"{4 * max(sizes) // (1 << 20) + 1024} MiB",
                segment_memory="legacy" if "-legacy" in method else "vmm" if "-vmm" in method else None,
            )
            if "gpupool" in method
            else None
        )
        pool = plugin is not None and not method.endswith(PLAIN_METHODS)
        variants = _variants(method, max(sizes))
        with H.cluster(workers, "ucxx", plugin) as c:
            info = T.workers(c)  # not scheduler_info(): see T.workers
            addrs = sorted(info, key=lambda w: str(info[w]["name"]))
            order = list(enumerate(addrs))[:: -1 if args.reverse else 1]
            gc_start = c.run(_gc_state)
            if method.endswith("-unstaged"):
                c.run(_set_staging_threshold, 2 * max(sizes))
            for i, src in order:
                for j, dst in order:
                    if i == j or (only and (i, j) not in only):
                        continue
                    for nbytes in sizes:
                        samples: dict[str, list[float]] = {v: [] for v, _ in variants}
                        addresses: dict[str, set[int]] = {}
                        for k in range(args.repeats + 1):
                            for v, settings in variants if k % 2 == 0 else variants[::-1]:
                                if "threshold" in settings:
                                    c.run(_set_staging_threshold, settings["threshold"])
                                if "off" in settings:
                                    c.run(_set_hooks, settings["off"])
                                if "inline" in settings:
                                    c.run(_set_inline, settings["inline"])
                                if "host_below" in settings:
                                    c.run(_set_host_frames, settings["host_below"])
                                if "receive" in settings:
                                    c.run(_set_receive, settings["receive"])
                                if "region" in settings:
                                    rotate = settings["region"]
                                    x = c.submit(_produce_in_one_allocation, nbytes, rotate, workers=[src], pure=False)
                                elif settings.get("driver"):
                                    x = c.submit(_produce_in_driver_allocation, nbytes, workers=[src], pure=False)
                                elif settings.get("outside"):
                                    x = c.submit(_produce_outside_pools, nbytes, workers=[src], pure=False)
                                else:
                                    x = c.submit(H.produce, nbytes, "cupy", pool, workers=[src], pure=False)
                                wait(x)
                                if method.endswith(("-region-ab", "-pool-ab", "-driver-ab")):
                                    where = c.submit(_address, x, workers=[src], pure=False).result()
                                    addresses.setdefault(v, set()).add(where)
                                y = c.submit(H.consume, x, workers=[dst], pure=False)
                                y.result()
                                t = c.run(T.last_transfer, key=x.key, workers=[dst])[dst]
                                del x, y
                                H.between_samples(c, plugin is not None)
                                if k and t is not None:
                                    samples[v].append(t)
                        for v, _ in variants:
                            name = f"{method}:{v}" if v else method
                            row = {"method": name, "run": run, "src": names[i], "dst": names[j], "nbytes": nbytes}
                            row["same_host"] = layout[i][0] == layout[j][0]
                            row["transfer_s"] = statistics.median(samples[v]) if samples[v] else None
                            row["samples"] = samples[v]
                            if v in addresses:
                                row["addresses"] = len(addresses[v])  # distinct device addresses sent
                            rows.append(row)
                            print(
                                f"{name:14s} {names[i]} -> {names[j]} {format_bytes(nbytes):>10}: "
                                f"{(row['transfer_s'] or float('nan')) * 1e3:8.2f} ms"
                                + (f" ({row['addresses']} addresses)" if "addresses" in row else "")
                                + _thirds(samples[v]),
                                flush=True,
                            )
            gc_end = c.run(_gc_state)
            cluster = method if args.methods.split(",").count(method) == 1 else f"{method}#{run}"  # named twice
            gcs[cluster] = {names[addrs.index(w)]: {"start": gc_start[w], "end": gc_end[w]} for w in addrs}
            if plugin is not None:
                got = c.run(T.handoff_counters)
                paths[cluster] = {names[addrs.index(w)]: {k: int(got[w].get(k, 0)) for k in PATH_KEYS} for w in addrs}
                timings[cluster] = {names[addrs.index(w)]: dict(got[w].get("timings", {})) for w in addrs}
        if len(variants) > 1:
            done = ab_summary(rows, method, [v for v, _ in variants], run)
            print(f"\n{method}: mean over pairs of each pair's ratio of medians", flush=True)
            _print_ab(done)
            summary.extend(done)
        result = {"machine": H.machine(), "layout": layout, "rows": rows, "paths": paths, "timings": timings, "gc": gcs}
        H.save_json("ucx_pairs", {**result, "ab": summary}, stamp)
    print(f"\nconsumer transfer time, median of {args.repeats} (ms); hosts by host-id, GPUs by index")
    methods = list(dict.fromkeys(r["method"] for r in rows))
    print(f"{'pair':<22}{'size':>10}" + "".join(f"{m:>16}" for m in methods))
    for nbytes in sizes:
        for i in range(len(layout)):
            for j in range(len(layout)):
                if i == j:
                    continue
                cells = []
                for m in methods:
                    r = next(
                        (
                            r
                            for r in rows
                            if (r["method"], r["src"], r["dst"], r["nbytes"]) == (m, names[i], names[j], nbytes)
                        ),
                        None,
                    )
                    cells.append(f"{(r['transfer_s'] or float('nan')) * 1e3 if r else float('nan'):16.2f}")
                print(f"{names[i] + ' -> ' + names[j]:<22}{format_bytes(nbytes):>10}" + "".join(cells))
    for method, by_worker in paths.items():
        print(f"\n{method}: bytes received by path")
        for w, counts in by_worker.items():
            print(f"  {w}: " + ", ".join(f"{k} {v:,}" for k, v in counts.items()))
    for method, by_worker in timings.items():
        print(f"\n{method}: mean ms per step (count)")
        for w, steps in by_worker.items():
            mean = {k: v["total_s"] / v["count"] * 1e3 for k, v in steps.items() if v["count"]}
            cells = [f"{k} {ms:.3f} ({steps[k]['count']})" for k, ms in mean.items()]
            print(f"  {w}: " + ", ".join(cells))
    for method, by_worker in gcs.items():
        print(f"\n{method}: garbage collector at start -> end (objects tracked, ms of a full collection)")
        for w, ends in by_worker.items():
            a, b = ends["start"], ends["end"]
            print(
                f"  {w}: {a['objects']:,} -> {b['objects']:,} objects, "
                f"{a['full_collect_s'] * 1e3:.1f} -> {b['full_collect_s'] * 1e3:.1f} ms, collections {b['collections']}"
            )
    if summary:
        print("\n-ab methods: mean over pairs of each pair's ratio of medians")
        _print_ab(summary)


if __name__ == "__main__":
    main()
