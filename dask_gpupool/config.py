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


#: ``gpupool.import-limit: auto`` for allocations of CUDA's IPC pool (not VMM segments): on two H200s (driver 580)
#: handoffs of single 6 and 8 GiB pool allocations did not complete within 60 s while 5 GiB ones took 7 ms to
#: import; VMM segments of 8 and 16 GiB mapped in 1.5-1.8 ms (H100, 2026-11-23, docs/performance.md).
POOL_MEMORY_IMPORT_LIMIT = 5 << 30

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
    ucx_receive_pool : int or None
        Most device memory (bytes) of the RMM pool that distributed-ucxx
        receives this worker's device frames into instead of a
        ``cudaMalloc`` per frame (:mod:`dask_gpupool.dask.ucx_receive`). 0:
        off. ``None`` (``auto``, the default): :data:`UCX_RECEIVE_POOL` on a
        worker that listens over UCX whose RMM resource is RMM's default
        (``CudaMemoryResource``), or this pool's own (``rmm-allocator``);
        off beside a resource someone else set (``distributed.rmm.pool-size``,
        dask-cuda's RMM options), which already serves the frames.
    peer_gpu_handoff : bool
        Hand ``device`` buffers over zero-copy to workers on other GPUs too:
        the pool grants those GPUs access when it is made. Only VMM segments
        go (``segment_memory``): pool memory imported on another GPU breaks
        the importer's CUDA context once its owner dies, and buffers imported
        one by one broke it under stress (docs/gpu-checks.md). ``auto`` (the
        default) means on with segments; :class:`~dask_gpupool.memory.pool.Pool`
        turns it off when the GPU cannot make VMM segments. Off, such
        transfers get copies, counted as fallback ``other-gpu``.
    handoff_ordering : {"sync", "event", "device"}
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
        synchronizes the whole of device 0). ``event``: it
        sends the descriptor at once; its broker waits for that event (or one
        recorded on the legacy default stream at the export, on the staging
        copy's stream for a staged array) before it acknowledges the
        consumer's claim, which the consumer waits for before it reads: the
        wait counts against the consumer's ``broker-timeout``, and the lease
        is claimed over the broker, a round trip more than ``sync``. On one
        H100 a handoff from a producer whose other stream ran 20 ms kernels
        took 2.8 ms with ``event`` and 17 ms when the whole GPU was
        synchronized (docs/performance.md).
    lease_claims : {"reply", "broker"}
        How an importer claims the lease of a handed-over buffer before it
        reads it. ``reply`` (the default): it holds the lease as soon as it
        has deserialized the descriptor, with no round trip; the exporter
        counts it claimed when it reads Dask's "OK" for the reply, and when
        the reply failed it asks the importer (over Dask's comm) which leases
        it holds, the others being refused for good as it answers
        (:mod:`dask_gpupool.handoff.leases`). ``broker``: a round trip to the
        exporter's broker before the importer reads (0.3-0.7 ms idle, more
        under load). With ``handoff-ordering: event`` leases are always
        claimed over the broker: its answer is the wait for the GPU.
    switch_interval : float or None
        Seconds: the worker process's Python thread switch interval
        (:func:`sys.setswitchinterval`), set while the plugin runs and put
        back at teardown. A thread that waits for the GIL behind a task
        holding it waits up to this long at each step, and a handoff's
        claim takes several such steps in the producer's broker thread: on
        the 2-vCPU CPU container, with a busy pure-Python task on the
        producer, a 1 MiB handoff took 36.5 ms at Python's default 5 ms
        (its claim 13.6 ms) and 16.9 ms at 0.5 ms (claim 1.8 ms); plain
        Dask's copy 30.8 and 19.2 ms (``benchmarks/busy_python.py``,
        docs/performance.md). ``None`` (the default): left as it is.
    """

    kind: PoolKind = "auto"
    device: int | str = 0
    max_size: Size = Size(fraction=0.5)
    host_id: str | None = None
    broker_dir: str | None = None
    broker_timeout: float = 10.0
    lease_timeout: float = 60.0
    peer_gpu_handoff: bool = True
    handoff_ordering: str = "sync"
    lease_claims: str = "reply"
    segment_size: int = 1 << 30
    suballocator: str = "auto"
    segment_memory: str = "auto"
    import_limit: int | None = None
    cupy_allocator: bool | None = None
    rmm_allocator: bool | None = None
    ucx_receive_pool: int | None = None
    switch_interval: float | None = None

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
            handoff_ordering=_parse_choice(raw.get("handoff-ordering", "sync"), "gpupool.handoff-ordering", ORDERINGS),
            lease_claims=_parse_choice(raw.get("lease-claims", "reply"), "gpupool.lease-claims", CLAIMS),
            segment_size=segment_size,
            suballocator=suballocator,
            segment_memory=segment_memory,
            import_limit=import_limit,
            cupy_allocator=cupy_allocator,
            rmm_allocator=rmm_allocator,
            ucx_receive_pool=_parse_receive_pool(raw.get("ucx-receive-pool", "auto")),
            switch_interval=_parse_switch_interval(raw.get("switch-interval")),
        )


#: ``gpupool.handoff-ordering``: wait before a descriptor goes out for the task's event (else the GPU), wait for an
#: event before acknowledging the consumer's claim, or synchronize the exporter's whole GPU before every descriptor.
ORDERINGS = ("sync", "event", "device")

#: ``gpupool.lease-claims``: an importer holds a lease once it has the header (the reply's "OK" tells the exporter),
#: or claims it over the exporter's broker first.
CLAIMS = ("reply", "broker")


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


def _parse_switch_interval(value: object) -> float | None:
    if value is None:
        return None
    seconds = _parse_timeout(value, "gpupool.switch-interval")
    if seconds > 1.0:
        raise ConfigError(f"gpupool.switch-interval={value!r} is over 1 s; valid: null, '0.5ms', '1ms' or seconds")
    return seconds


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
