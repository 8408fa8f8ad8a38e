"""What dask_gpupool's NumPy serializer adds in front of distributed's, per array (no cluster, no GPU).

Every NumPy array a worker sends goes through ``dask_serialize`` for
``numpy.ndarray``, which dask_gpupool wraps (to hand over arrays made over
pool buffers). This times, in one process, distributed's own serializer, the
same call through the wrapper, and ``distributed.protocol.serialize`` as a
comm calls it, for a small array (best of 5 repeats).

    python benchmarks/serializer_overhead.py [--n 20000] [--size 128]
"""

from __future__ import annotations

import argparse
import timeit

import numpy as np


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=20000, help="calls per repeat")
    p.add_argument("--size", type=int, default=128, help="float64 elements")
    args = p.parse_args()
    import distributed.protocol.numpy as distributed_numpy
    from distributed.protocol import dask_serialize, serialize

    x = np.ones(args.size)

    def best(fn: object) -> float:
        return min(timeit.repeat(fn, number=args.n, repeat=5)) / args.n  # type: ignore[arg-type]

    own = best(lambda: distributed_numpy.serialize_numpy_ndarray(x))
    import dask_gpupool  # noqa: F401  (registers the wrapper)

    wrapper = dask_serialize.dispatch(np.ndarray)
    assert wrapper is not distributed_numpy.serialize_numpy_ndarray
    wrapped = best(lambda: wrapper(x))
    full = best(lambda: serialize(x, serializers=("dask", "pickle")))
    print(f"{args.size}-element float64 array, best of 5 x {args.n} calls")
    print(f"distributed's NumPy serializer   {own * 1e6:8.2f} us")
    print(f"through dask_gpupool's wrapper   {wrapped * 1e6:8.2f} us")
    print(f"distributed.protocol.serialize() {full * 1e6:8.2f} us")


if __name__ == "__main__":
    main()
