"""What each of the plugin's hooks costs a transfer it does not hand over, measured inside one cluster.

Clusters started one after another differ by more than the plugin's per-transfer work (on a 2-vCPU container a
4 KiB NumPy transfer between two "hosts" took 1.25-1.98 ms at the median depending on the cluster, with or without
the plugin), so comparing a cluster with the plugin against one without cannot say what the plugin costs. Here one
cluster with the plugin takes every sample in each mode back to back, in alternating order:

- ``all on``: the plugin as it runs;
- ``no get_data hook``: the worker's ``get_data`` handler put back to Dask's (no :data:`REQUEST`, no routing);
- ``no read wrapper``: the comms a worker reads values from not wrapped (``fill_after_read(undo=True)``);
- ``Dask's serializers``: distributed's own NumPy serializers registered again in place of dask_gpupool's.

The value is a plain NumPy array of ``--nbytes`` on ``host`` pools (no GPU needed), made outside the pool and sent
to a worker of another host id (``--same-host``: the same host id), so that it goes through Dask's comm in every
mode; the transfer time is the consumer's ``stop - start`` of its transfer log entry. JSON to
``benchmarks/results/``.

    python benchmarks/plugin_hooks.py [--samples 300] [--nbytes 4096] [--same-host]
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
from typing import Any

from distributed import wait

sys.path.insert(0, os.path.dirname(__file__))
import handoff as H  # benchmarks/handoff.py: its cluster, produce/consume and save_json

from dask_gpupool import GPUPool
from dask_gpupool import testing as T

#: mode -> (get_data hook on, read wrapper on, dask_gpupool's serializers on)
MODES = {
    "all on": (True, True, True),
    "no get_data hook": (False, True, True),
    "no read wrapper": (True, False, True),
    "Dask's serializers": (True, True, False),
}


def set_mode(dask_worker: Any, hook: bool, wrap: bool, ours: bool) -> None:
    """On a worker: switch the plugin's hooks on or off (the first call records what the plugin installed)."""
    import numpy as np
    from distributed.protocol import numpy as dask_numpy
    from distributed.protocol.serialize import dask_deserialize, dask_serialize

    from dask_gpupool.dask import comms, worker_plugin
    from dask_gpupool.dask.distributed_seam import workers as seam

    if not hasattr(dask_worker, "_gpupool_bench_hooks"):
        dask_worker._gpupool_bench_hooks = {
            "get_data": dask_worker.handlers["get_data"],
            "numpy": (dask_serialize.dispatch(np.ndarray), dask_deserialize.dispatch(np.ndarray)),
        }
    installed = dask_worker._gpupool_bench_hooks
    hooked = installed["get_data"]
    dask_worker.handlers["get_data"] = hooked if hook else getattr(hooked, "__wrapped__", hooked)
    # the plugin's wrap binds each new comm to its worker (dask/comms.py); "no read wrapper" leaves new comms unbound
    bind = functools.partial(comms.bind, worker_plugin.service_of(dask_worker)) if wrap else None
    seam.fill_after_read(dask_worker, bind, undo=not wrap)
    dumps, loads = (
        installed["numpy"] if ours else (dask_numpy.serialize_numpy_ndarray, dask_numpy.deserialize_numpy_ndarray)
    )
    dask_serialize.register(np.ndarray)(dumps)
    dask_deserialize.register(np.ndarray)(loads)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=300)
    p.add_argument("--nbytes", type=int, default=4096)
    p.add_argument("--same-host", action="store_true")
    args = p.parse_args()
    hosts = ["a", "a" if args.same_host else "b"]
    workers = [{"config": {"gpupool": {"host-id": h}}} for h in hosts]
    samples: dict[str, list[float]] = {m: [] for m in MODES}
    with H.cluster(workers, "tcp", GPUPool(kind="host", max_size="64 MiB")) as c:
        info = T.workers(c)  # not scheduler_info(): see T.workers
        a, b = sorted(info, key=lambda w: str(info[w]["name"]))
        for k in range(args.samples + 3):
            for mode in list(MODES) if k % 2 else list(MODES)[::-1]:
                hook, wrap, ours = MODES[mode]
                c.run(set_mode, hook=hook, wrap=wrap, ours=ours)
                x = c.submit(H.produce, args.nbytes, "numpy", False, workers=[a], pure=False)
                wait(x)
                c.submit(H.consume, x, workers=[b], pure=False).result()
                t = c.run(T.last_transfer, key=x.key, workers=[b])[b]
                del x
                if k >= 3 and t is not None:  # the first rounds warm the comms up
                    samples[mode].append(t)
        c.run(set_mode, hook=True, wrap=True, ours=True)
    print(f"{args.nbytes} B NumPy, {'same' if args.same_host else 'another'} host id, {args.samples} samples each")
    rows = []
    for mode, values in samples.items():
        row = {"mode": mode, "median_s": statistics.median(values), "mean_s": statistics.mean(values)}
        rows.append(row)
        print(f"  {mode:20s} median {row['median_s'] * 1e3:.3f} ms  mean {row['mean_s'] * 1e3:.3f} ms")
    H.save_json("plugin_hooks", {"machine": H.machine(), "args": vars(args), "rows": rows, "samples": samples})


if __name__ == "__main__":
    main()
