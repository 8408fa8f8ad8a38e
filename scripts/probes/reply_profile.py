"""Probe: ``cProfile`` on a worker's event loop while other-"host" ``get_data`` requests are answered.

Four ``Nanny`` workers with ``host`` pools, ``gpupool.host-id`` set so that w0, w1 are "host-a" and w2, w3
"host-b"; w0 makes a NumPy array of ``NBYTES`` (argument 1, default 1 MiB) and w2 consumes it, ``REPEATS``
times (argument 2, default 200), after three warm-up transfers. The profile covers only the thread it is enabled
in: the producer's event loop, where ``get_data`` and the serializers run (argument 3 ``producer``, the default), or
the consumer's (``consumer``), where the reply is read and deserialized. Prints the profile's lines of
``dask_gpupool``'s functions, by cumulative time. The profiler inflates small Python calls several-fold, so the
result ranks the plugin's functions on a reply rather than timing them. Runs without a GPU.

Run: ``python3 scripts/probes/reply_profile.py [NBYTES] [REPEATS] [producer|consumer]``.
"""

from __future__ import annotations

import os
import sys
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
import handoff as H  # benchmarks/handoff.py: its cluster
from distributed import wait

from dask_gpupool import GPUPool


def _produce(nbytes: int) -> Any:
    import numpy as np

    return np.ones(max(nbytes // 8, 1))


def _consume(x: Any) -> int:
    return int(x.nbytes)


def _profile_start(dask_worker: Any = None) -> None:
    import cProfile

    dask_worker._probe_profile = cProfile.Profile()
    dask_worker._probe_profile.enable()


def _profile_stop(dask_worker: Any = None) -> str:
    import io
    import pstats

    profile = dask_worker._probe_profile
    profile.disable()
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("cumulative").print_stats("dask_gpupool", 40)
    return out.getvalue()


def main() -> None:
    nbytes = int(sys.argv[1]) if len(sys.argv) > 1 else 1 << 20
    repeats = int(sys.argv[2]) if len(sys.argv) > 2 else 200
    side = sys.argv[3] if len(sys.argv) > 3 else "producer"
    if side not in ("producer", "consumer"):
        raise SystemExit(f"side {side!r}: producer or consumer")
    workers = [{"config": {"gpupool": {"host-id": host}}} for host in ("host-a", "host-a", "host-b", "host-b")]
    with H.cluster(workers, "tcp", GPUPool(kind="host", max_size="256 MiB")) as c:
        info = c.scheduler_info()["workers"]
        addrs = sorted(info, key=lambda w: str(info[w]["name"]))
        src, dst = addrs[0], addrs[2]
        profiled = src if side == "producer" else dst
        for k in range(3 + repeats):
            if k == 3:
                c.run(_profile_start, workers=[profiled])
            x = c.submit(_produce, nbytes, workers=[src], pure=False)
            wait(x)
            c.submit(_consume, x, workers=[dst], pure=False).result()
            del x
        print(c.run(_profile_stop, workers=[profiled])[profiled])


if __name__ == "__main__":
    main()
