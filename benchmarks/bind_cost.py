"""What binding a comm to the member at its other end costs a new connection, measured inside one cluster.

A worker binds each comm it opens to a worker of its registry before Dask uses it (two small round trips under the
cluster token: :mod:`dask_gpupool.dask.comms`). Dask pools comms, so the cost is paid once per connection, never
per transfer. Here worker B opens a new comm to worker A and closes it, ``--samples`` times in each mode, in
alternating order, on ``host`` pools (no GPU needed):

- ``connect + bind``: B's ``rpc.connect`` as the plugin wraps it (bind, read wrapper);
- ``connect``: Dask's own connect, the same comm without the bind.

JSON to ``benchmarks/results/``.

    python benchmarks/bind_cost.py [--samples 300]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(__file__))
import handoff as H  # benchmarks/handoff.py: its cluster, machine and save_json

from dask_gpupool import GPUPool
from dask_gpupool import testing as T


async def connect_times(peer: str, samples: int, dask_worker: Any) -> dict[str, list[float]]:
    """On a worker: seconds to open (and bind) a new comm to ``peer``, by mode; each comm is closed after."""
    from dask_gpupool.dask.comms import bound_worker

    wrapped = dask_worker.rpc.connect
    modes = {"connect + bind": wrapped, "connect": wrapped.__wrapped__}
    out: dict[str, list[float]] = {m: [] for m in modes}
    for k in range(samples + 3):
        for mode in list(modes) if k % 2 else list(modes)[::-1]:
            start = time.perf_counter()
            comm = await modes[mode](peer)
            elapsed = time.perf_counter() - start
            assert (bound_worker(comm) == peer) == (mode == "connect + bind"), mode
            dask_worker.rpc.reuse(peer, comm)
            await comm.close()
            if k >= 3:  # the first rounds warm up
                out[mode].append(elapsed)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=300)
    args = p.parse_args()
    with H.cluster([{}, {}], "tcp", GPUPool(kind="host", max_size="64 MiB")) as c:
        info = T.workers(c)  # not scheduler_info(): see T.workers
        a, b = sorted(info, key=lambda w: str(info[w]["name"]))
        samples = c.run(connect_times, a, args.samples, workers=[b])[b]
    print(f"a new comm from one worker to another, {args.samples} samples each")
    rows = []
    for mode, values in samples.items():
        row = {"mode": mode, "median_s": statistics.median(values), "mean_s": statistics.mean(values)}
        rows.append(row)
        print(f"  {mode:16s} median {row['median_s'] * 1e3:.3f} ms  mean {row['mean_s'] * 1e3:.3f} ms")
    H.save_json("bind_cost", {"machine": H.machine(), "args": vars(args), "rows": rows, "samples": samples})


if __name__ == "__main__":
    main()
