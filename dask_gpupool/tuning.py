"""The sizes and counts the transfer paths decide by: measured, not configured.

No ``gpupool.*`` key sets these. Each constant is the value measured best, with what it decides and the figure
behind it (machine, date); ``docs/performance.md`` holds the runs.
:func:`~dask_gpupool.handoff.routes.stage_threshold_of` and :func:`~dask_gpupool.handoff.routes.handoff_threshold_of`
pick the thresholds of a pool kind and comm.

The product never changes them. To measure or test another size: :class:`~dask_gpupool.handoff.routes.Routes`
takes the routing thresholds as collaborators, which :func:`dask_gpupool.testing.faults.route_sizes` replaces in
one worker (``client.run``); the others are read from this module where they are used (the copy chunk when a
worker's copy server starts), so a benchmark sets them as module attributes in its workers' processes
(``benchmarks/ucx_pairs.py``).
"""

from __future__ import annotations

__all__ = [
    "COPY_CHUNK_SIZE",
    "COPY_STREAMS",
    "COPY_STREAM_THRESHOLD",
    "HOST_HANDOFF_THRESHOLD",
    "HOST_KEEP_RESIDENT",
    "HOST_STAGE_THRESHOLD",
    "STAGE_THRESHOLD",
    "UCX_HOST_FRAME_THRESHOLD",
    "UCX_STAGING_THRESHOLD",
]

#: The smallest copy to another worker over TCP pulled over the pipelined copy path
#: (:mod:`dask_gpupool.transport.stream`); smaller ones travel in Dask's frames, which spares the copy server's
#: connections. Not measured at other sizes: from 256 MiB up the path was 2.95-3.46x faster than Dask TCP (the H200
#: host, 2026-11-22).
COPY_STREAM_THRESHOLD = 4 << 20

#: The chunk of the pipelined copy path; each lane keeps two chunks of pinned staging on each side. Pulls of 256 MiB /
#: 1 GiB / 4 GiB on the H200 host (2026-11-22, ``benchmarks/results/copy-sweep-20261122/``) took 56.4 / 192.4 / 760.8 ms
#: in 16 MiB chunks over four lanes, 63.0 / 215.4 / 745.2 in 64 MiB chunks, 60.8 / 197.7 / 775.8 in 8 MiB over eight.
COPY_CHUNK_SIZE = 16 << 20

#: Lanes (TCP connections, each with its staging and CUDA stream) one copy is pulled over. On the H200 host
#: (2026-11-22) one loopback connection moved 4.6-6.4 GB/s and four 16-20 GB/s (``scripts/probes/copy_pipeline.py``);
#: a 256 MiB pull took 56.4 ms over four lanes, 65.6 over one and 59.9 over eight, equal from 1 GiB.
COPY_STREAMS = 4

#: Plain arrays outside the pool from this size up, asked for by a same-host worker over TCP or TLS, are copied into a
#: ``device`` pool and handed over (:func:`~dask_gpupool.handoff.routes.stage_threshold_of`). Each sample staged and
#: sent through the comm back to back (``benchmarks/copy_or_handoff.py --plain``): staging won 31 of 40 pairs at 64 KiB
#: and 20 of 40 at 1 KiB on one H100 (same GPU, 2026-11-24); the comm won 30-32% at 64-256 KiB and 60% at 1 KiB on two
#: H200s (other GPU, 2026-11-24).
STAGE_THRESHOLD = 64 << 10

#: Plain NumPy arrays from this size up (to :data:`HOST_KEEP_RESIDENT`), asked for by a same-host worker over TCP or
#: TLS, are copied into a ``host`` pool and handed over (:func:`~dask_gpupool.handoff.routes.stage_threshold_of`);
#: smaller ones go Dask's way. Each sample staged, through the plugin's comm and through a cluster without the plugin,
#: one after another (``benchmarks/host_staging.py --sizes 128KiB,256KiB,512KiB,768KiB,1MiB,2MiB --samples 20``, 2-vCPU
#: container, 2026-12-05, dask_gpupool 0.1.0, ``host_staging-20261205-115129-cpu-threshold.json``), transfer plus the
#: consumer's first read: staging won 5-6 of 20 pairs at 256 KiB (1.12-1.14x the comm's time), 9-11 at 512 KiB
#: (0.97-1.01x), 11-12 at 768 KiB (0.89-0.93x), 16-17 at 1 MiB (0.82-0.84x) and 16 at 2 MiB (0.65-0.70x).
HOST_STAGE_THRESHOLD = 1 << 20

#: ``host`` pool buffers under this size go to a same-host worker over TCP or TLS as a copy in Dask's frames, not a
#: handoff (:func:`~dask_gpupool.handoff.routes.handoff_threshold_of`). On a 2-vCPU container (2026-11-23,
#: ``benchmarks/copy_or_handoff.py``, 300 pairs per size) the two were within 0.08 ms up to 32 KiB; the copy was faster
#: in 22-35% of pairs at 64 KiB and 3-13% at 128 KiB-1 MiB.
HOST_HANDOFF_THRESHOLD = 64 << 10

#: A ``host`` pool's freed buffers keep their pages in the pool's first this many bytes (where first fit places the
#: next buffers); pages beyond go back to the OS at once, every free one at a trim
#: (:class:`~dask_gpupool.memory.host.SharedHostMemoryResource`). A page given back costs its next write a fault that
#: allocates and zeroes it, 4 KiB at a time: on a 2-vCPU container (2026-12-05, dask_gpupool 0.1.0,
#: ``benchmarks/host_staging.py``, ``host_staging-20261205-114727-cpu-pages-given-back.json``) a copy of 64 MiB into
#: given-back pages took 73.3 ms against 7.5 into resident ones (16,424 faults), 256 MiB 319 against 18.6, 1 GiB 1164
#: against 69; giving 64 MiB back cost 11.7 ms more. That was the whole of a staged handoff's loss to Dask's TCP path
#: (64 MiB: 77.8 ms staged against 28.4). It bounds the memory a worker keeps resident in no live buffer (``trim``
#: gives it back, as does a worker past its first memory threshold: ``dask.spilling.borrowed_pages_check``), and the
#: largest array staged into a ``host`` pool.
HOST_KEEP_RESIDENT = 512 << 20

#: Over UCX, pool memory under this size goes to UCX as it is rather than copied into ``cuMemAlloc`` memory first:
#: UCX 1.21 sends any device memory under 8 KiB eagerly through host bounce buffers. On one H100 (2026-11-23,
#: ``benchmarks/ucx_pairs.py``) other-"host" pairs took 1.90 ms unstaged against 2.09 staged at 4 KiB (8 of 8 pairs).
UCX_STAGING_THRESHOLD = 8 << 10

#: Over UCX, a CuPy array or pool Buffer under this size in a reply to a worker running the plugin goes as one host
#: frame, as UCX's eager protocol would move it, without the comm's GPU synchronizes and the receiver's ``cudaMalloc``.
#: On one H100 (2026-11-24, ``benchmarks/ucx_pairs.py``) 4 KiB other-"host" pool arrays took 1.67 ms against 1.87 (8 of
#: 8 pairs); at 1 MiB host frames were 1.45-1.51x slower.
UCX_HOST_FRAME_THRESHOLD = 8 << 10
