"""One gather of several pool arrays from one worker: what a reply of many handoffs costs.

Dask fetches the keys a task needs from one worker in one ``get_data`` reply.
Each pool array in it is a handoff whose lease the consumer claims before it
reads; the claims of one reply go to the exporter together, after the comm
read (``dask_gpupool.handoff.deferred.claim_later``). This times the
consumer's transfer of ``k`` such arrays for each ``k`` of ``--values``
(``stop - start`` of Dask's transfer-log entry, median of ``--repeats`` after
three warm-ups), with the per-step timings of ``stats()``::

    python benchmarks/gather.py [--values 1,8,32] [--repeats 40] [--nbytes 1024]

Two worker processes on one host (one GPU, or host pools without one). JSON to
``benchmarks/results/gather-*.json``.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

from distributed import Client, LocalCluster, wait
from handoff import save_json  # benchmarks/handoff.py (this directory is on sys.path when run as a script)

import dask_gpupool
from dask_gpupool import GPUPool
from dask_gpupool import testing as T
from dask_gpupool.memory.topology import local_devices


def produce(nbytes: int, lib: str) -> Any:
    """An array of ``nbytes`` over a pool buffer, set to 1."""
    n = max(nbytes // 8, 1)
    arr = dask_gpupool.as_array(dask_gpupool.allocate(n * 8), (n,), "f8", like=lib)
    arr[...] = 1.0
    if lib == "cupy":
        import cupy

        cupy.cuda.runtime.deviceSynchronize()
    return arr


def consume(*arrays: Any) -> int:
    return sum(int(a.nbytes) for a in arrays)


def transfer_of(keys: list[str], dask_worker: Any) -> tuple[float, int] | None:
    """``stop - start`` of the latest transfer that carried one of ``keys``, and how many keys it carried."""
    for entry in reversed(dask_worker.transfer_incoming_log):
        if set(keys) & set(entry["keys"]):
            return float(entry["stop"] - entry["start"]), len(entry["keys"])
    return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--values", default="1,8,32")
    p.add_argument("--repeats", type=int, default=40)
    p.add_argument("--nbytes", type=int, default=1024)
    args = p.parse_args()
    gpu = bool(local_devices().uuids)
    lib, kind = ("cupy", "device") if gpu else ("numpy", "host")
    rows = []
    with (
        LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0") as cluster,
        Client(cluster) as c,
    ):
        c.register_plugin(GPUPool(kind=kind, max_size="1 GiB"))
        a, b = sorted(c.scheduler_info()["workers"])
        for k in [int(v) for v in args.values.split(",") if v]:
            before = dask_gpupool.stats(c)[b].get("timings", {})
            samples, carried = [], 0
            for i in range(args.repeats + 3):
                xs = [c.submit(produce, args.nbytes, lib, workers=[a], pure=False) for _ in range(k)]
                wait(xs)
                c.submit(consume, *xs, workers=[b], pure=False).result()
                got = c.run(transfer_of, [x.key for x in xs], workers=[b])[b]
                if i >= 3 and got is not None:
                    samples.append(got[0])
                    carried = got[1]
                del xs
                c.run(T.handoff_counters)  # a full collection on each worker, and until the leases ended
            after = dask_gpupool.stats(c)[b].get("timings", {})
            claims = after.get("claim", {"count": 0, "total_s": 0.0})
            was = before.get("claim", {"count": 0, "total_s": 0.0})
            n_claims = claims["count"] - was["count"]
            row = {
                "values": k,
                "keys_per_gather": carried,
                "median_s": statistics.median(samples),
                "claims": n_claims,
                "claim_mean_s": (claims["total_s"] - was["total_s"]) / n_claims if n_claims else None,
            }
            rows.append(row)
            print(
                f"{k:3d} values ({carried} keys per gather): transfer {row['median_s'] * 1e3:7.2f} ms, "
                f"{n_claims} claims"
                + (f" of {row['claim_mean_s'] * 1e3:.2f} ms" if row["claim_mean_s"] is not None else ""),
                flush=True,
            )
    save_json("gather", {"lib": lib, "kind": kind, "args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
