"""Copy or handoff for small pool values, each sample taken both ways back to back in one cluster.

The handoff threshold (``dask_gpupool.handoff.routes.handoff_threshold_of``) sends pool buffers under it to a same-host
worker over TCP as a copy in Dask's frames instead of a handoff. Clusters started one after another differ by as much as
the two paths do (0.1-0.5 ms in a CPU container, 2026-11-23), so one cluster with the plugin takes every sample handed
over (the threshold 0) and copied (the threshold above every size) back to back, in alternating order, switching the
producer's threshold between them: :func:`dask_gpupool.testing.faults.route_sizes` gives it to the producer's routing
(``client.run``), which holds values against it instead of the constant.

``--plain`` asks the same of the stage threshold (``dask_gpupool.handoff.routes.stage_threshold_of``): plain CuPy (or
NumPy) arrays, from the library's own allocator, staged into the producer's pool and handed over (the threshold at 1
byte) or sent through Dask's comm (0, fallback ``not-in-pool``).

Two same-host workers (``--placement other`` with two GPUs: one per GPU); pool arrays of each ``--sizes`` over
``device`` pools with a GPU, ``host`` pools without (``--kind`` overrides); the transfer time is the consumer's
``stop - start`` of its transfer log entry, median of ``--samples``. JSON to ``benchmarks/results/``.

    python benchmarks/copy_or_handoff.py [--sizes 1KiB,16KiB,64KiB,256KiB,1MiB] [--samples 100] [--kind host] [--plain]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

from dask.utils import format_bytes, parse_bytes
from distributed import wait

sys.path.insert(0, os.path.dirname(__file__))
import handoff as H  # benchmarks/handoff.py: its cluster, produce/consume, placements and save_json

from dask_gpupool import GPUPool
from dask_gpupool import testing as T
from dask_gpupool.memory.topology import local_devices


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="1KiB,16KiB,64KiB,256KiB,1MiB")
    p.add_argument("--samples", type=int, default=100)
    p.add_argument("--kind", default="", help="pool kind (default: device with a GPU, else host)")
    p.add_argument("--placement", default="same", choices=["same", "other"])
    p.add_argument("--plain", action="store_true", help="plain arrays: staged into the pool or through the comm")
    args = p.parse_args()
    gpus = len(local_devices().uuids)
    kind = args.kind or ("device" if gpus else "host")
    lib = "cupy" if kind == "device" else "numpy"
    sizes = [int(parse_bytes(s)) for s in args.sizes.split(",")]
    if args.placement == "other" and gpus < 2:
        raise SystemExit("--placement other needs two GPUs")
    workers = H.placements(gpus)[args.placement] if gpus else [{}, {}]
    if args.plain:  # a stage threshold of 0 turns staging off: the array goes through the comm
        option, modes = "stage", {"handoff": 1, "copy": 0}
    else:
        option, modes = "handoff", {"handoff": 0, "copy": 2 * max(sizes)}
    samples: dict[tuple[str, int], list[float]] = {(m, n): [] for m in modes for n in sizes}
    plugin = GPUPool(kind=kind, max_size=f"{4 * max(sizes) // (1 << 20) + 256} MiB")
    with H.cluster(workers, "tcp", plugin) as c:
        info = T.workers(c)  # not scheduler_info(): see T.workers
        a, b = sorted(info, key=lambda w: str(info[w]["name"]))
        for nbytes in sizes:
            for k in range(args.samples + 3):
                for mode in list(modes) if k % 2 else list(modes)[::-1]:
                    c.run(T.route_sizes, **{option: modes[mode]}, workers=[a])
                    x = c.submit(H.produce, nbytes, lib, not args.plain, workers=[a], pure=False)
                    wait(x)
                    c.submit(H.consume, x, workers=[b], pure=False).result()
                    t = c.run(T.last_transfer, key=x.key, workers=[b])[b]
                    del x
                    H.between_samples(c, True)
                    if k >= 3 and t is not None:  # the first rounds warm the comms up
                        samples[mode, nbytes].append(t)
        counters = c.run(T.handoff_counters)
    what = "plain arrays staged (handoff) or through the comm (copy)" if args.plain else "pool arrays"
    print(f"{kind} pools, {what}, {args.placement} placement, over TCP, median of {args.samples} samples each (ms)")
    print(f"{'size':>10}{'handoff':>10}{'copy':>10}{'copy faster':>14}")
    rows = []
    for nbytes in sizes:
        h, cp = samples["handoff", nbytes], samples["copy", nbytes]
        faster = sum(y < x for x, y in zip(h, cp, strict=False)) / max(len(h), 1)
        row = {"nbytes": nbytes, "handoff_s": statistics.median(h), "copy_s": statistics.median(cp)}
        row["copy_faster_share"] = faster
        rows.append(row)
        print(f"{format_bytes(nbytes):>10}{row['handoff_s'] * 1e3:10.3f}{row['copy_s'] * 1e3:10.3f}{faster:13.0%}")
    fallbacks = {w: counters[w].get("fallbacks", {}) for w in counters}
    print("fallbacks:", fallbacks)
    result = {"machine": H.machine(), "args": vars(args), "kind": kind, "rows": rows, "fallbacks": fallbacks}
    result["samples"] = {f"{m}-{n}": v for (m, n), v in samples.items()}
    H.save_json("copy_or_handoff", result)


if __name__ == "__main__":
    main()
