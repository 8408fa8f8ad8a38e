"""Configuration: the ``gpupool`` namespace of ``dask.config``, read here only.

Defaults live in ``gpupool.yaml`` and each key is documented in
``gpupool-schema.yaml`` beside this module. :meth:`PoolOptions.from_config`
is the one place that reads and checks them; everything else receives a
:class:`PoolOptions`.
"""

from __future__ import annotations

import math
import os
import pathlib
import re
from dataclasses import dataclass
from typing import Any, Literal, cast

import dask.config
import yaml
from dask.utils import parse_bytes, parse_timedelta

from dask_gpupool.errors import ConfigError

__all__ = ["KINDS", "PoolKind", "PoolOptions", "Size"]

PoolKind = Literal["auto", "device", "pinned", "host"]
KINDS: tuple[PoolKind, ...] = ("auto", "device", "pinned", "host")

_HERE = pathlib.Path(__file__).parent
with open(_HERE / "gpupool.yaml") as _f:
    _defaults = yaml.safe_load(_f)
dask.config.update_defaults(_defaults)


#: The largest ``gpupool.copy-chunk-size``, and the largest chunk an importer takes from a copy server's
#: ``PullReply``: each lane stages three chunks in pinned or vkgdr memory, so a peer's chunk is bounded too.
MAX_COPY_CHUNK = 1 << 30

#: ``gpupool.import-limit: auto`` for allocations of CUDA's IPC pool (not VMM segments): on two H200s (driver 580)
#: handoffs of single 6 and 8 GiB pool allocations did not complete within 60 s while 5 GiB ones took 7 ms to
#: import; VMM segments of 8 and 16 GiB mapped in 1.5-1.8 ms (H100, 2026-11-23, docs/performance.md).
POOL_MEMORY_IMPORT_LIMIT = 5 << 30

#: ``stage-threshold: auto`` on ``device`` pools, to a worker on another GPU over TCP or TLS: from 64 KiB, as on the
#: same GPU (:data:`SAME_GPU_STAGE_THRESHOLD`; over UCX ``auto`` stages nothing, ``effective_stage_threshold`` says
#: why). Measured on two H200s (NVLink, driver 580), each sample staged and sent through the comm back to back in one
#: cluster (benchmarks/copy_or_handoff.py --plain --placement other, 40 samples per size, 2026-11-24 22:35,
#: docs/performance.md "Twenty-sixth session"): staged and handed over 1.66-1.87 ms from 1 KiB to 1 MiB and 2.04 at
#: 4 MiB, through the comm 1.70-2.50 ms and 7.17 at 4 MiB; the comm was faster in 60% of the pairs at 1 KiB, 38% at
#: 16 KiB, 30-32% at 64-256 KiB, 2% at 1 MiB and none at 4 MiB. On the dask.array workloads (8192^2 float64 in
#: 2048^2 chunks, four rounds, a fresh cluster per method and round) staging from 64 KiB instead of 4 MiB took
#: 0.91-1.02x as long with one worker per GPU (faster in 3-4 of 4 rounds on six of eight workloads) and 0.93-1.10x
#: with two (1.10 on ``rmm_objects``, whose buffers the threshold does not touch); map_overlap's halo strips no longer
#: go through the host (0-0.1 MiB a run instead of 4.8-8.6). It was 4 MiB from the twenty-second session's
#: workloads (matmul 2.0-2.7x faster than TCP) until then.
DEVICE_STAGE_THRESHOLD = 64 << 10

#: ``stage-threshold: auto`` on ``device`` pools, to a worker on the pool's GPU: from 64 KiB. Measured on one H100
#: with leases claimed by the reply, each sample staged and sent through the comm back to back in one cluster
#: (benchmarks/copy_or_handoff.py --plain --placement same, 40 samples per size, 2026-11-24 01:32,
#: docs/performance.md): staged and handed over 2.50-2.63 ms from 1 KiB to 4 MiB, through the comm 2.56-3.14 ms to
#: 1 MiB and 8.39 at 4 MiB; staging was faster in 20 of 40 back-to-back pairs at 1 KiB (a tie), 26 at 16 KiB, 31 at
#: 64 KiB, 28 at 256 KiB, 37 at 1 MiB and all 40 at 4 MiB. Staging every size (``stage-threshold: 1``) was no faster
#: on the dask.array workloads, whose small values are partial sums of a few KiB; from 64 KiB the halo strips of
#: ``map_overlap`` are staged too (0.03 MiB through the comm instead of 11 MiB). Since contiguous arrays are staged
#: with one driver copy (2026-11-24 03:22), staging was faster than the comm at every size from 1 KiB (22-30 of 30
#: pairs), yet staging every size was still no faster on the workloads (1.02-1.29x the defaults, seven rounds).
SAME_GPU_STAGE_THRESHOLD = 64 << 10

#: ``handoff-threshold: auto`` on ``host`` pools: a pool buffer smaller than 64 KiB goes to a same-host worker over
#: TCP as a copy in Dask's frames (landing in the receiver's pool) instead of a handoff. Measured on a 2-vCPU container
#: with leases claimed by the reply, each sample taken both ways back to back in one cluster
#: (benchmarks/copy_or_handoff.py, two runs of 150 samples per size, 2026-11-23 22:30, docs/cpu-users.md): up to
#: 32 KiB the two were within 0.08 ms (the copy faster in 49-66% of the pairs), from 64 KiB the handoff was faster
#: (the copy faster in 22-35% of the pairs at 64 KiB, 3-13% at 128 KiB-1 MiB). It was 256 KiB while claims cost a
#: round trip to the exporter's broker.
HOST_HANDOFF_THRESHOLD = 64 << 10

#: ``handoff-threshold: auto`` on ``device`` pools, to a worker on another GPU: none, every size is handed over, as
#: on the same GPU. Measured on two H200s (NVLink) with leases claimed by the reply, each sample handed over and copied
#: back to back in one cluster (benchmarks/copy_or_handoff.py --placement other, 60 samples per size, 2026-11-24
#: 22:34, docs/performance.md "Twenty-sixth session"): handed over 1.65-1.81 ms from 1 KiB to 1 MiB, copied
#: 1.79-2.64 ms; the copy was faster in 23% of the pairs at 1 KiB, 32% at 16 KiB, 12% at 64 KiB, 8% at 256 KiB and 5%
#: at 1 MiB. It was 1 MiB while claims cost a round trip to the exporter's broker (2026-11-23: a copy 1.57-1.70 ms to
#: 512 KiB against 2.08-2.14 handed over).
DEVICE_HANDOFF_THRESHOLD = 0

#: ``handoff-threshold: auto`` on ``device`` pools, to a worker on the same GPU: none, every size is handed over.
#: Measured on one H100 with leases claimed by the reply, each sample taken handed over and copied back to back in one
#: cluster (benchmarks/copy_or_handoff.py --placement same, 60 samples per size, 2026-11-23 23:25,
#: docs/performance.md): handed over 1.83-2.02 ms from 1 KiB to 1 MiB, copied 2.18-2.54 ms; the copy was faster in
#: 28% of the pairs at 1 KiB, 23% at 16 KiB, 7-8% at 64-256 KiB and none at 1 MiB.
SAME_GPU_HANDOFF_THRESHOLD = 0

#: ``ucx-staging-threshold`` by default: pool memory under 8 KiB goes to UCX as it is, not copied into
#: ``cuMemAlloc`` memory first. UCX 1.21 (``UCX_PROTO_INFO``) sends any device memory under 8 KiB eagerly through host
#: bounce buffers over its TCP transport, plain CuPy arrays with UCXX alone included, so a staging copy buys nothing
#: there, and from 8 KiB to 4 MiB moves pool memory (which its ``cuda_ipc`` cannot export) with its own ``cuda_copy``
#: pipeline; above 4 MiB it falls back to host fragments, hence staging from some size on. Measured on one H100, four
#: workers as two "hosts", staged and unstaged samples back to back in one cluster (benchmarks/ucx_pairs.py
#: ``ucxx+gpupool-ab``, 2026-11-23 22:04, docs/performance.md): other-host pairs unstaged 1.90 against 2.09 ms at 4 KiB
#: (faster on all 8 pairs) and 2.08 against 2.21 ms at 64 KiB (6 of 8). Those "hosts" shared one machine, where UCX
#: reaches the other process by ``cuda_ipc`` and TCP over loopback. Between real hosts (InfiniBand, GPUDirect RDMA)
#: UCX picks other protocols from 8 KiB up, and whether it moves pool memory there as well as ``cuMemAlloc`` memory
#: is not measured; below 8 KiB it copies device memory into host bounce buffers whatever the transport. So the
#: default stays at the eager limit, where giving UCX the pool memory itself cannot change its path.
UCX_STAGING_THRESHOLD = 8 << 10

#: ``ucx-host-frame-threshold`` by default: a CuPy array (or a pool Buffer) under 8 KiB in a reply over UCX to a worker
#: running the plugin goes as one host frame (copied to the host by the sender, back to the GPU by the receiver) rather
#: than as a device frame. Below 8 KiB UCX 1.21 sends device memory eagerly through host bounce buffers itself, so the
#: bytes take the same way; done by the plugin the transfer skips distributed-ucxx's GPU synchronize on both sides, the
#: receiver's ``cudaMalloc`` and ``cudaFree`` of the frame (0.04-0.05 ms each on one H100,
#: scripts/probes/recv_alloc.py) and UCX's device-memory handling. Measured on one H100, four workers as two "hosts",
#: every sample both ways back to back in one cluster (benchmarks/ucx_pairs.py ``-hostframes-ab``, 2026-11-24 20:31,
#: docs/performance.md): at 4 KiB other-host pool arrays 1.67 against 1.87 ms (8 of 8 pairs faster), plain CuPy arrays
#: 1.73 against 1.90 (8 of 8); at 64 KiB also faster (0.86-0.89x), at 1 MiB much slower (1.45-1.51x). From 8 KiB UCX
#: moves device memory GPU to GPU, so the default stays at its eager limit: no byte goes through the host that UCX
#: would not have sent through it.
UCX_HOST_FRAME_THRESHOLD = 8 << 10

#: ``ucx-receive-pool: auto``: the most device memory the pool that distributed-ucxx receives device frames into may
#: reserve (:mod:`dask_gpupool.dask.ucx_receive`). Without it distributed-ucxx 0.52 makes an ``rmm.DeviceBuffer`` per
#: frame from RMM's current resource, which on a worker without an RMM pool is a ``cudaMalloc`` and later a
#: ``cudaFree``. Measured on one H100, four workers as two "hosts", pool arrays, every sample taken four ways back to
#: back in one cluster (benchmarks/ucx_pairs.py ``-recvrmm-ab``, 2026-11-25 02:30, docs/performance.md): other-host
#: pairs received into an RMM pool took 0.86 / 0.95 / 0.85x UCXX alone's path at 64 KiB / 1 MiB / 4 MiB (8, 5 and 8 of
#: 8 pairs at or below), against 1.10 / 1.10 / 1.08x with a ``cudaMalloc`` per frame (1, 0 and 0 of 8).
#: Frames that do not fit under it go to RMM's resource as before.
UCX_RECEIVE_POOL = 1 << 30


@dataclass(frozen=True)
class Size:
    """A pool size: either absolute bytes or a share of some capacity.

    Attributes
    ----------
    nbytes : int or None
        Absolute size in bytes.
    fraction : float or None
        Share in (0, 1] of the memory behind the pool, resolved by
        :meth:`resolve` once the capacity is known.
    """

    nbytes: int | None = None
    fraction: float | None = None

    @classmethod
    def parse(cls, value: object, key: str = "gpupool.max-size") -> Size:
        """Parse ``8589934592``, ``"8 GiB"``, ``"50%"`` or ``0.5`` (also written as text, ``"0.5"``)."""
        valid = 'bytes (8589934592 or "8 GiB") or a share ("50%" or 0.5)'
        if isinstance(value, bool) or value is None:
            raise ConfigError(f"{key}={value!r} is not a size; use {valid}")
        if isinstance(value, int):
            if value <= 0:
                raise ConfigError(f"{key}={value!r} must be positive; use {valid}")
            return cls(nbytes=value)
        if isinstance(value, float):
            if not (0.0 < value <= 1.0) or math.isnan(value):
                raise ConfigError(f"{key}={value!r}: a share must be in (0, 1]; use {valid}")
            return cls(fraction=value)
        if isinstance(value, str):
            text = value.strip()
            if text.endswith("%"):
                try:
                    share = float(text[:-1]) / 100.0
                except ValueError:
                    raise ConfigError(f"{key}={value!r} is not a size; use {valid}") from None
                return cls.parse(share, key)
            if re.fullmatch(r"\d*\.\d+|\d+\.", text):
                # a decimal without a unit is a share, as the float 0.5 is: text from preload arguments
                # (--gpupool-max-size 0.5) or quoted YAML, which parse_bytes would truncate to 0 or 1 bytes
                return cls.parse(float(text), key)
            try:
                nbytes = parse_bytes(text)
            except (ValueError, TypeError, OverflowError):
                raise ConfigError(f"{key}={value!r} is not a size; use {valid}") from None
            return cls.parse(int(nbytes), key)
        raise ConfigError(f"{key}={value!r} is not a size; use {valid}")

    def resolve(self, capacity: int, what: str, key: str = "gpupool.max-size") -> int:
        """Bytes for a pool backed by ``capacity`` bytes of ``what``.

        Raises
        ------
        ConfigError
            If an absolute size exceeds ``capacity``.
        """
        if self.fraction is not None:
            return max(1, int(capacity * self.fraction))
        assert self.nbytes is not None
        if self.nbytes > capacity:
            raise ConfigError(
                f"{key}={self.nbytes} bytes exceeds the {capacity} bytes of {what}; "
                f'use at most {capacity} bytes or a share such as "50%"'
            )
        return self.nbytes

    def __str__(self) -> str:
        if self.fraction is not None:
            return f"{self.fraction:.0%}"
        return f"{self.nbytes} bytes"


@dataclass(frozen=True)
class PoolOptions:
    """Every option of a worker's pool, parsed and checked.

    Attributes
    ----------
    kind : {"auto", "device", "pinned", "host"}
        Requested pool kind; ``auto`` is resolved when the pool is made.
    device : int or str
        GPU ordinal in this process's ``CUDA_VISIBLE_DEVICES``, or a device UUID.
    max_size : Size
        Upper bound of the pool.
    host_id : str or None
        Host identity override; ``None`` means hostname + kernel boot id.
    broker_dir : str or None
        Parent directory of the broker's private directory, absolute (a
        relative path is taken under the worker's working directory).
    broker_timeout : float
        Seconds a broker waits for a request, and a client for a reply.
    lease_timeout : float
        Seconds after which a lease still unclaimed is logged, and for which a
        peer whose transfer failed gets copies (no timer ends a lease).
    cupy_allocator : bool or None
        Route CuPy's allocations on the worker through its ``device`` or
        ``pinned`` pool, so that plain CuPy results hand over zero-copy.
        ``None`` (``auto``, the default): CuPy keeps its allocator (its
        own pool, or dask-cuda's RMM), and ``stage_threshold`` moves its
        arrays on the GPU instead (:func:`dask_gpupool.dask.cupy_routing.decide`
        says why; ``stats()["routing"]`` shows it).
    rmm_allocator : bool or None
        Make the RMM pool inside the ``device`` pool's segments RMM's resource
        for the worker's GPU, and RMM CuPy's allocator, so that CuPy arrays
        and ``rmm.DeviceBuffer`` objects tasks make hand over zero-copy with
        no staging copy (:mod:`dask_gpupool.dask.rmm_routing`). ``None``
        (``auto``, the default): RMM keeps its resource (dask-cuda's
        included), and ``stage_threshold`` moves what it allocates on the GPU
        instead: its GPU tests pass on two H200s, and on the workloads it was
        as fast as staging (0.83-1.07x of it). Exclusive with ``cupy_allocator``.
    segment_size : int
        ``device`` pools: bytes of the segments buffers are placed in, which
        peers map once (:mod:`dask_gpupool.memory.segments`); 0 turns segments off
        (each buffer is its own CUDA allocation, imported anew by each peer).
    suballocator : {"auto", "rmm", "arena"}
        What places buffers inside segments: RMM's pool (``auto`` when RMM is
        installed) or the in-tree arena.
    segment_memory : {"auto", "vmm", "legacy", "pool"}
        ``device`` pools: what segments are made of. ``vmm``: CUDA virtual
        memory exported as POSIX fds, whose memory outlives its maker for the
        peers that map it (:mod:`dask_gpupool.memory.vmm`); ``legacy``:
        ``cuMemAlloc`` memory shared by legacy IPC handles, which outlives its
        maker too and which UCX sends GPU to GPU without a staging copy
        (:mod:`dask_gpupool.memory.legacy`; 8 and 16 GiB buffers hand over
        zero-copy on one H100); ``pool``: allocations of the IPC-enabled
        pool, which a peer on another GPU can no longer read once their
        owner's process died. ``auto``: ``legacy`` on a worker that listens
        over UCX (on one H100 other-"host" pool arrays then went 0.75-0.85x
        of UCXX alone's path at 8 KiB-4 MiB, every pair at or below in four
        runs of five, against 0.80-0.96x with VMM segments and the staging
        copy, one to three pairs of eight above), else ``vmm``, each when the
        GPU supports it (else ``vmm``, then ``pool``).
    import_limit : int or None
        ``device`` pools: the largest CUDA allocation (a buffer, or the
        segment it lies in) handed over zero-copy; larger ones are copied
        (fallback ``too-large``). 0: no limit. ``None`` (``auto``, the
        default): no limit for VMM and legacy IPC segments,
        :data:`POOL_MEMORY_IMPORT_LIMIT` for allocations of CUDA's IPC pool
        (:meth:`effective_import_limit`).
    ucx_handoff_threshold : int
        Smallest value handed over zero-copy to a same-host worker on UCX
        comms; smaller pool memory goes as device frames, which UCX moves
        faster than a handoff's round trips. 0: every value is handed over.
    ucx_staging_threshold : int
        Smallest pool value copied into ``cuMemAlloc`` memory before it goes
        to UCX as a device frame (:mod:`dask_gpupool.memory.ucx_staging`);
        smaller pool memory is given to UCX as it is, which UCX 1.21 moves
        with its own protocols (eager through host bounce buffers below
        8 KiB, as for any device memory; its ``cuda_copy`` pipeline up to
        4 MiB). Default :data:`UCX_STAGING_THRESHOLD` (8 KiB): on one H100,
        with staged and unstaged samples taken back to back, unstaged was
        faster at 4 KiB (every pair) and 64 KiB; above 8 KiB UCX's path
        between real hosts is not measured. 0: every value is staged.
    ucx_host_frame_threshold : int
        On UCX comms, CuPy arrays and pool Buffers below this many bytes in a
        ``get_data`` reply to a worker running the plugin (that are not
        handed over) go as one host frame instead of a device frame:
        copied to the host by the sender and back to the GPU by the
        receiver, the way UCX's eager protocol moves device memory
        below 8 KiB anyway, without the comm's GPU synchronizes and the
        receiver's ``cudaMalloc``. Counted in ``host_frames_out_bytes`` and
        ``host_frames_bytes``. Default :data:`UCX_HOST_FRAME_THRESHOLD`
        (8 KiB); 0: none.
    ucx_receive_pool : int or None
        Most device memory (bytes) of the RMM pool that distributed-ucxx
        receives this worker's device frames into instead of a
        ``cudaMalloc`` per frame (:mod:`dask_gpupool.dask.ucx_receive`). 0:
        off. ``None`` (``auto``, the default): :data:`UCX_RECEIVE_POOL` on a
        worker that listens over UCX whose RMM resource is RMM's default
        (``CudaMemoryResource``), or this pool's own (``rmm-allocator``);
        off beside a resource someone else set (``distributed.rmm.pool-size``,
        dask-cuda's RMM options), which already serves the frames.
    copy_chunk_size : int
        Chunk of the pipelined copy path (:mod:`dask_gpupool.transport.stream`); 0 sends
        every copy in Dask's frames.
    copy_stream_threshold : int
        Smallest copy sent over the pipelined copy path; smaller ones travel
        in Dask's frames.
    copy_streams : int
        Connections (lanes) one copy is pulled over, each with its own
        staging and CUDA stream; at most 16.
    stage_threshold : int or None
        Smallest array outside the pool that is copied into it on the
        producer (device to device for CuPy) and handed over when a same-host
        worker asks for it over TCP, instead of going through distributed's
        serializer (host memory and TCP), or over UCX when the worker is on
        the same GPU (instead of UCX's copy). 0: never. ``None`` (``auto``, the
        default): on ``device`` pools :data:`SAME_GPU_STAGE_THRESHOLD`
        (64 KiB) to a worker on the pool's GPU over TCP or TLS and
        :data:`DEVICE_STAGE_THRESHOLD` (64 KiB) to one on another GPU; never
        over UCX, whose own GPU-to-GPU copy was as fast or faster on the
        workloads, and never on ``host`` pools, where it measured slower
        (:meth:`effective_stage_threshold`).
    handoff_threshold : int or None
        Smallest pool buffer handed over to a same-host worker over TCP or
        TLS; smaller ones go as copies in Dask's frames (fallback ``small``),
        which is faster there than a handoff's lease claim. 0: hand over at
        every size. ``None`` (``auto``, the default):
        :data:`HOST_HANDOFF_THRESHOLD` (64 KiB) on ``host`` pools; on
        ``device`` pools :data:`SAME_GPU_HANDOFF_THRESHOLD` (0) to a worker
        on the pool's GPU and :data:`DEVICE_HANDOFF_THRESHOLD` (0) to one
        on another GPU; 0 on ``pinned`` pools
        (:meth:`effective_handoff_threshold`).
    device_objects : bool
        Send every object with a ``"cuda"`` serializer (``rmm.DeviceBuffer``,
        Numba device arrays, cuDF objects, a user's type) to same-host
        workers over TCP frame by frame through the pool
        (:mod:`dask_gpupool.dask.device_objects`). On by default: on one
        H100 (two workers) ``rmm_objects`` in ``benchmarks/workloads.py``
        took 111-125 ms with it, 309-322 ms without (1.1-1.4 GB copied per
        run), UCXX 87-103, the other workloads unchanged; off, they go
        through distributed's serializer, copied through the host.
    peer_gpu_handoff : bool
        Hand ``device`` buffers over zero-copy to workers on other GPUs too:
        the pool grants those GPUs access when it is made. Only VMM segments
        go (``segment_memory``): pool memory imported on another GPU breaks
        the importer's CUDA context once its owner dies, and buffers imported
        one by one broke it under stress (docs/gpu-checks.md). ``auto`` (the
        default) means on with segments; :class:`~dask_gpupool.memory.pool.Pool`
        turns it off when the GPU cannot make VMM segments. Off, such
        transfers get copies, counted as fallback ``other-gpu``.
    handoff_ordering : {"sync", "device"}
        How an exporter makes sure the GPU work that wrote a buffer has
        finished before a peer reads it. ``sync`` (the default): it waits
        before the descriptor goes out. For a task result of its own (a pool
        array, a pool Buffer, an array RMM placed in the pool) it waits for
        the event it recorded on the legacy default stream when Dask stored
        the result, which follows every blocking stream's earlier work, CuPy's
        default included: kernels queued since, and other streams', are not
        waited for. For anything else (a value whose event is not known) it
        synchronizes its GPU, as for every value with ``device``, which also
        covers work a task left on a non-blocking stream without waiting for
        it (the only thing ``sync`` leaves out; distributed-ucxx's comm
        synchronizes the whole of device 0).
    tcp_landing : {"auto", "pinned", "vkgdr"}
        Where a value pulled from another host over TCP lands on its way
        into this worker's pool (:mod:`dask_gpupool.transport.pull`):
        ``pinned`` receives each chunk into pinned host staging and copies it
        to the GPU; ``vkgdr`` receives it straight into GPU memory that vkgdr
        maps into the host (the optional ``vkgdr`` extra, with the Vulkan
        loader and NVIDIA's Vulkan driver), then copies it device to device
        (:mod:`dask_gpupool.transport.vkgdr_staging`); ``auto`` (the default):
        vkgdr where it runs, pinned staging elsewhere (said once, at INFO).
        On one H100 a pull of 256 MiB / 1 GiB took 55.7 / 200.6 ms with
        vkgdr against 78.4 / 265.4 ms through pinned staging
        (docs/performance.md).
    peer_gpu_copy : bool
        A ``device`` buffer handed over from another GPU of this host is
        copied into this worker's pool when it arrives, device to device over
        NVLink or PCIe, and its lease ends at once; off, kernels read it where
        it is. On two H200s a kernel reading its operand from the other GPU
        ran 2.8-10x slower than from its own memory (a 2048^2 float64 matrix
        product 4.5x), where copying the 32 MiB operand took 0.1 ms
        (``benchmarks/peer_read.py``, docs/performance.md). Off by default:
        its GPU tests pass on two H200s, but on the ``dask.array`` workloads
        (staged 32 MiB blocks) it was no faster than reading in place,
        0.84-1.14x the default's wall time (docs/performance.md).
    """

    kind: PoolKind = "auto"
    device: int | str = 0
    max_size: Size = Size(fraction=0.5)
    host_id: str | None = None
    broker_dir: str | None = None
    broker_timeout: float = 10.0
    lease_timeout: float = 60.0
    peer_gpu_handoff: bool = True
    peer_gpu_copy: bool = False
    handoff_ordering: str = "sync"
    tcp_landing: str = "auto"
    segment_size: int = 1 << 30
    suballocator: str = "auto"
    segment_memory: str = "auto"
    import_limit: int | None = None
    cupy_allocator: bool | None = None
    rmm_allocator: bool | None = None
    ucx_handoff_threshold: int = 0
    ucx_staging_threshold: int = 8 << 10
    ucx_host_frame_threshold: int = 8 << 10
    ucx_receive_pool: int | None = None
    copy_chunk_size: int = 16 << 20
    copy_stream_threshold: int = 4 << 20
    copy_streams: int = 4
    stage_threshold: int | None = None
    handoff_threshold: int | None = None
    device_objects: bool = True

    def effective_stage_threshold(self, kind: str, same_gpu: bool = False, over_tcp: bool = True) -> int:
        """The stage threshold of a pool of ``kind`` (``"device"``, ``"pinned"``, ``"host"``) for a requester on this
        pool's GPU (``same_gpu``) or another, asking over TCP or TLS (``over_tcp``) or UCX; 0: never. With
        ``same_gpu`` over TCP it is also the lowest for any requester.

        ``auto`` stages nothing over UCX: UCX already copies the array GPU to GPU, and with each workload run
        both ways in one cluster, alternating run by run (one H100, docs/performance.md "Twenty-first session on
        one H100"), staging from 4 MiB was 0.97-1.02x UCX's copy on seven workloads and 0.92x on one (elementwise,
        11 of 16 pairs): no gain that one call's spread does not cover, for pool memory that UCX does not need.
        A threshold the user sets holds over every comm."""
        if self.stage_threshold is not None:
            return self.stage_threshold
        if kind != "device" or not over_tcp:
            return 0
        return SAME_GPU_STAGE_THRESHOLD if same_gpu else DEVICE_STAGE_THRESHOLD

    def effective_handoff_threshold(self, kind: str, same_gpu: bool = False) -> int:
        """The handoff threshold of a pool of ``kind`` for a requester on this pool's GPU (``same_gpu``) or not:
        smaller buffers go to same-host workers as copies; 0: none."""
        if self.handoff_threshold is not None:
            return self.handoff_threshold
        if kind == "device" and same_gpu:
            return SAME_GPU_HANDOFF_THRESHOLD
        return {"host": HOST_HANDOFF_THRESHOLD, "device": DEVICE_HANDOFF_THRESHOLD}.get(kind, 0)

    def effective_import_limit(self, pool_memory: bool) -> int:
        """The import limit of a pool whose buffers are allocations of CUDA's IPC pool (``pool_memory``) or lie in
        segments of VMM or legacy IPC memory (not ``pool_memory``); 0: none."""
        if self.import_limit is not None:
            return self.import_limit
        return POOL_MEMORY_IMPORT_LIMIT if pool_memory else 0

    @classmethod
    def from_config(cls, **overrides: Any) -> PoolOptions:
        """Read ``dask.config["gpupool"]``, apply non-``None`` overrides, check all.

        Override names are the keys with ``_`` for ``-`` (``max_size=...``).

        Raises
        ------
        ConfigError
            Naming the key, the bad value and the valid values.
        """
        return cls._from(dask.config.get("gpupool", default={}) or {}, overrides)

    @classmethod
    def from_overrides(cls, **overrides: Any) -> PoolOptions:
        """The shipped defaults (``gpupool.yaml``) with non-``None`` overrides applied, all checked; this process's
        dask config is not read.

        What :class:`~dask_gpupool.GPUPool` checks where it is made (a client, or the scheduler's preload): each
        value given, and the values given against each other. The options left out are each worker's own config,
        read and checked by :meth:`from_config` on that worker, not the config of the process that made the plugin.

        Raises
        ------
        ConfigError
            Naming the key, the bad value and the valid values.
        """
        return cls._from(_defaults["gpupool"], overrides)

    @classmethod
    def _from(cls, config: dict[str, Any], overrides: dict[str, Any]) -> PoolOptions:
        # Dask treats "_" and "-" in keys alike (DASK_GPUPOOL__MAX_SIZE sets gpupool.max_size): so do we.
        raw: dict[str, Any] = {str(k).replace("_", "-"): v for k, v in config.items()}
        unknown = set(raw) - {f.replace("_", "-") for f in cls.__dataclass_fields__}
        if unknown:
            raise ConfigError(
                f"unknown option(s) {sorted('gpupool.' + k for k in unknown)}; valid: "
                f"{sorted('gpupool.' + f.replace('_', '-') for f in cls.__dataclass_fields__)}"
            )
        for name, value in overrides.items():
            if name not in cls.__dataclass_fields__:
                raise ConfigError(f"unknown option {name!r}; valid: {sorted(cls.__dataclass_fields__)}")
            if value is not None:
                raw[name.replace("_", "-")] = value
        segment_size = _parse_nbytes(raw.get("segment-size", "1 GiB"), "gpupool.segment-size")
        rmm = raw.get("rmm-allocator", "auto")
        rmm_allocator = None if rmm == "auto" else _parse_bool(rmm, "gpupool.rmm-allocator")
        cupy = raw.get("cupy-allocator", "auto")
        cupy_allocator = None if cupy == "auto" else _parse_bool(cupy, "gpupool.cupy-allocator")
        if rmm_allocator and cupy_allocator:
            raise ConfigError(
                "gpupool.rmm-allocator and gpupool.cupy-allocator are both on: choose one "
                "(rmm-allocator gives CuPy RMM's allocator over the pool)"
            )
        peer = raw.get("peer-gpu-handoff", "auto")
        peer_gpu_handoff = segment_size > 0 if peer == "auto" else _parse_bool(peer, "gpupool.peer-gpu-handoff")
        suballocator = raw.get("suballocator", "auto")
        if suballocator not in ("auto", "rmm", "arena"):
            raise ConfigError(f"gpupool.suballocator={suballocator!r} is not a suballocator; valid: auto, rmm, arena")
        segment_memory = raw.get("segment-memory", "auto")
        if segment_memory not in ("auto", "vmm", "legacy", "pool"):
            raise ConfigError(f"gpupool.segment-memory={segment_memory!r} is not valid; valid: auto, vmm, legacy, pool")
        if peer_gpu_handoff and peer != "auto" and (segment_memory == "pool" or not segment_size):
            raise ConfigError(
                "gpupool.peer-gpu-handoff=true needs segments of VMM or legacy IPC memory (gpupool.segment-size > 0 "
                f"and gpupool.segment-memory auto, vmm or legacy; got {segment_size} and {segment_memory!r}): "
                "pool memory read from another GPU breaks the reader's CUDA context once its owner's process dies"
            )
        if peer == "auto" and segment_memory == "pool":
            peer_gpu_handoff = False
        raw_limit = raw.get("import-limit", "auto")
        import_limit = None if raw_limit == "auto" else _parse_nbytes(raw_limit, "gpupool.import-limit")
        limited = segment_memory == "pool"  # single large imports of CUDA's IPC pool stalled at 6-8 GiB
        bound = POOL_MEMORY_IMPORT_LIMIT if import_limit is None and limited else import_limit
        if bound and segment_size > bound:
            segment_size = bound  # a larger segment could not be mapped by any peer
        return cls(
            kind=_parse_kind(raw.get("kind", "auto")),
            device=_parse_device(raw.get("device", 0)),
            max_size=Size.parse(raw.get("max-size", "50%")),
            host_id=_parse_optional_str(raw.get("host-id"), "gpupool.host-id"),
            broker_dir=_parse_broker_dir(raw.get("broker-dir")),
            broker_timeout=_parse_timeout(raw.get("broker-timeout", "10s"), "gpupool.broker-timeout"),
            lease_timeout=_parse_timeout(raw.get("lease-timeout", "60s"), "gpupool.lease-timeout"),
            peer_gpu_handoff=peer_gpu_handoff,
            peer_gpu_copy=_parse_bool(raw.get("peer-gpu-copy", False), "gpupool.peer-gpu-copy"),
            handoff_ordering=_parse_choice(raw.get("handoff-ordering", "sync"), "gpupool.handoff-ordering", ORDERINGS),
            tcp_landing=_parse_choice(raw.get("tcp-landing", "auto"), "gpupool.tcp-landing", LANDINGS),
            segment_size=segment_size,
            suballocator=suballocator,
            segment_memory=segment_memory,
            import_limit=import_limit,
            cupy_allocator=cupy_allocator,
            rmm_allocator=rmm_allocator,
            ucx_handoff_threshold=_parse_nbytes(raw.get("ucx-handoff-threshold", 0), "gpupool.ucx-handoff-threshold"),
            ucx_staging_threshold=_parse_nbytes(
                raw.get("ucx-staging-threshold", UCX_STAGING_THRESHOLD), "gpupool.ucx-staging-threshold"
            ),
            ucx_host_frame_threshold=_parse_nbytes(
                raw.get("ucx-host-frame-threshold", UCX_HOST_FRAME_THRESHOLD), "gpupool.ucx-host-frame-threshold"
            ),
            ucx_receive_pool=_parse_receive_pool(raw.get("ucx-receive-pool", "auto")),
            copy_chunk_size=_parse_copy_chunk(raw.get("copy-chunk-size", "16 MiB")),
            copy_stream_threshold=_parse_nbytes(
                raw.get("copy-stream-threshold", "4 MiB"), "gpupool.copy-stream-threshold"
            ),
            copy_streams=_parse_count(raw.get("copy-streams", 4), "gpupool.copy-streams", 1, 16),
            stage_threshold=None
            if raw.get("stage-threshold", "auto") == "auto"
            else _parse_nbytes(raw.get("stage-threshold"), "gpupool.stage-threshold"),
            handoff_threshold=None
            if raw.get("handoff-threshold", "auto") == "auto"
            else _parse_nbytes(raw.get("handoff-threshold"), "gpupool.handoff-threshold"),
            device_objects=_parse_bool(raw.get("device-objects", True), "gpupool.device-objects"),
        )


#: ``gpupool.handoff-ordering``: wait before a descriptor goes out for the task's event (else the GPU), or synchronize
#: the exporter's whole GPU before every descriptor.
ORDERINGS = ("sync", "device")

#: ``gpupool.tcp-landing``: pinned host staging, GPU memory vkgdr maps into the host, or vkgdr where it runs.
LANDINGS = ("auto", "pinned", "vkgdr")


def _parse_choice(value: object, key: str, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise ConfigError(f"{key}={value!r} is not valid; valid: {', '.join(choices)}")
    return str(value)


def _parse_bool(value: object, key: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false", "yes", "no", "1", "0"):
        return value.strip().lower() in ("true", "yes", "1")
    raise ConfigError(f"{key}={value!r} is not a boolean; valid: true or false")


def _parse_kind(value: object) -> PoolKind:
    if value not in KINDS:
        raise ConfigError(f"gpupool.kind={value!r} is not a pool kind; valid: {', '.join(KINDS)}")
    return cast(PoolKind, value)


def _parse_device(value: object) -> int | str:
    if isinstance(value, bool):
        value = None
    if isinstance(value, int) and value >= 0:
        return value
    if isinstance(value, str) and value.strip():
        text = value.strip()
        return int(text) if text.isdigit() else text
    raise ConfigError(f"gpupool.device={value!r} is not a device; valid: an ordinal >= 0 or a device UUID ('GPU-...')")


def _parse_optional_str(value: object, key: str) -> str | None:
    if isinstance(value, int) and not isinstance(value, bool):
        value = str(value)  # DASK_GPUPOOL__HOST_ID=42: Dask's environment parsing makes digits an int
    if value is None or (isinstance(value, str) and value):
        return value
    raise ConfigError(f"{key}={value!r} must be a non-empty string or null")


def _parse_broker_dir(value: object) -> str | None:
    """``gpupool.broker-dir`` as an absolute path: a relative one is under this process's working directory.

    Peers connect to the broker socket by the path in the registry row, which must be absolute.
    """
    path = _parse_optional_str(value, "gpupool.broker-dir")
    return None if path is None else os.path.abspath(os.path.expanduser(path))


def _parse_nbytes(value: object, key: str) -> int:
    nbytes: int | None = None
    if isinstance(value, int) and not isinstance(value, bool):
        nbytes = value
    elif isinstance(value, str):
        try:
            nbytes = int(parse_bytes(value))
        except (ValueError, TypeError, OverflowError):  # OverflowError: past a float ("1e400")
            nbytes = None
    if nbytes is None or nbytes < 0:
        raise ConfigError(f"{key}={value!r} is not a size; valid: '1 GiB', '256MiB', bytes, or 0 for off")
    return nbytes


def _parse_copy_chunk(value: object) -> int:
    """``gpupool.copy-chunk-size``: a size up to :data:`MAX_COPY_CHUNK`, or 0 (copies in Dask's frames)."""
    nbytes = _parse_nbytes(value, "gpupool.copy-chunk-size")
    if nbytes > MAX_COPY_CHUNK:
        raise ConfigError(f"gpupool.copy-chunk-size={value!r} is over {MAX_COPY_CHUNK} bytes (1 GiB)")
    return nbytes


def _parse_receive_pool(value: object) -> int | None:
    """``gpupool.ucx-receive-pool``: ``auto`` (``None``), a size (bytes; 0 is off), or a boolean (``true``:
    :data:`UCX_RECEIVE_POOL`, ``false``: 0)."""
    if value == "auto" or value is None:
        return None
    key = "gpupool.ucx-receive-pool"
    try:
        return _parse_nbytes(value, key)
    except ConfigError:
        pass
    try:
        return UCX_RECEIVE_POOL if _parse_bool(value, key) else 0
    except ConfigError:
        valid = "auto, true, false, or a size such as '1 GiB'"
        raise ConfigError(f"{key}={value!r} is not valid; valid: {valid}") from None


def _parse_count(value: object, key: str, low: int, high: int) -> int:
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value.strip())
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ConfigError(f"{key}={value!r} is not a count; valid: an integer from {low} to {high}")
    return value


def _parse_timeout(value: object, key: str) -> float:
    seconds: float | None = None
    if isinstance(value, (str, int, float)) and not isinstance(value, bool):
        try:
            seconds = parse_timedelta(value, default="s")
        except (ValueError, TypeError, KeyError, IndexError, OverflowError):  # IndexError: "" (an empty env var)
            seconds = None
    if seconds is None or seconds <= 0:
        raise ConfigError(f"{key}={value!r} is not a positive duration; valid: '10s', '500ms' or seconds")
    return float(seconds)
