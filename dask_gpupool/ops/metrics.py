"""Prometheus metrics on Dask's own ``/metrics`` endpoints.

Dask serves ``prometheus_client``'s default registry on every worker's and
the scheduler's HTTP server. The plugins add one collector per process to
that registry (:func:`register`), named in Dask's style:

========================================================  =======  ==============================
metric                                                    type     labels
========================================================  =======  ==============================
``dask_worker_gpupool_pool_bytes``                        gauge    ``state``: used, free
``dask_worker_gpupool_pool_limit_bytes``                  gauge
``dask_worker_gpupool_leases``                            gauge
``dask_worker_gpupool_leased_bytes``                      gauge
``dask_worker_gpupool_mapped_pools``                      gauge
``dask_worker_gpupool_handoffs_total``                    counter  ``direction``: export, import, forward, return
``dask_worker_gpupool_received_bytes_total``              counter  ``path``: zero-copy, copy, device-frames,
                                                                   host-frames
``dask_worker_gpupool_sent_copy_bytes_total``             counter
``dask_worker_gpupool_staged_bytes_total``                counter
``dask_worker_gpupool_ucx_quarantined_bytes``             gauge
``dask_worker_gpupool_fallbacks_total``                   counter  ``reason`` (see ``FALLBACK_REASONS``)
``dask_worker_gpupool_leases_abandoned_total``            counter
``dask_worker_gpupool_leases_in_doubt``                   gauge
``dask_worker_gpupool_segments``                          gauge    ``state``: held, retiring
``dask_scheduler_gpupool_pools``                          gauge    ``kind``
========================================================  =======  ==============================

Summed over a label, a metric means something: ``pool_bytes`` over ``state`` (used, and free: reserved but in no
live buffer) is the bytes the pool reserves; its bound is ``pool_limit_bytes``.

What each counts is its help text, and docs/operations.rst: ``received_bytes`` counts values from any sender
(only its ``zero-copy`` path is same-host by nature), and ``sent_copy_bytes`` every host
copy of a pool value, to workers of any host, clients and disk (spilling).

Every worker metric also carries a ``worker`` label (the worker's Dask name),
so that a restarted worker (a new pool UUID, a new address) continues its
series. ``prometheus_client`` is optional, as it is for Dask: without it
nothing is registered.

Several workers in one process (``LocalCluster(processes=False)``, tests)
share one Prometheus registry, which Dask serves on each of their ``/metrics``
and on the scheduler's. So that each series is served once, by one endpoint,
each server's own ``/metrics`` is routed through a subclass of Dask's handler
(:func:`dask_gpupool.dask.distributed_seam.workers.scope_metrics`) that tells the
collectors which server asks (:func:`serving`, :data:`_SERVING`: ``collect()``
takes no argument, so a ContextVar is the only way): a worker's serves that
worker's series alone, the scheduler's the scheduler's alone. A figure of the whole process
(``ucx_quarantined_bytes``: :data:`~dask_gpupool.memory.lifetime.QUARANTINE`
is one per process) is served once, under the process's first worker with a
pool. Scraped any other way (an exporter of the user's own), the registry
gives every series of the process, each once.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["register", "register_scheduler", "serving"]

#: ``received_bytes``: only ``zero-copy`` is same-host by nature; ``copy``, ``device-frames`` and ``host-frames``
#: count whoever sent the value.
RECEIVED_HELP = (
    "Bytes of values received, by path: zero-copy (a same-host peer's pool mapped, or a value of this pool come back), "
    "copy (host copies from any sender, workers of other hosts included), device-frames and host-frames (over UCX, "
    "from any sender)."
)
#: ``sent_copy_bytes``: every host copy this worker's serializers counted (a pool value, an array outside the pool,
#: the arrays of a pickled object), whoever it was for.
SENT_COPY_HELP = (
    "Bytes of values sent as host copies (pool values, arrays outside the pool, the arrays of pickled objects), "
    "whoever they went to: workers of this host (fallbacks) and of other hosts, the scheduler and clients, and disk "
    "when spilled."
)

_lock = threading.Lock()
_registered: set[str] = set()
_scheduler_source: Callable[[], dict[str, int]] | None = None

#: Which server's ``/metrics`` is being served, as ``(role, address)`` (``role``: ``"worker"`` or ``"scheduler"``);
#: ``None`` outside Dask's handlers, where the collectors give every series of the process.
_SERVING: contextvars.ContextVar[tuple[str, str] | None] = contextvars.ContextVar("gpupool_serving", default=None)


@contextlib.contextmanager
def serving(role: str, address: str) -> Iterator[None]:
    """The collectors give the series of the server at ``address`` (``role``: ``"worker"`` or ``"scheduler"``) alone
    while this is open (the server's own ``/metrics`` handler opens it)."""
    token = _SERVING.set((role, address))
    try:
        yield
    finally:
        _SERVING.reset(token)


def _worker_metrics() -> Iterator[Any]:
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    from dask_gpupool.handoff.registry import active_services
    from dask_gpupool.handoff.stats import FALLBACK_REASONS

    every = active_services()
    home = every[0] if every else None  # where the process's own figures are served
    serving = _SERVING.get()
    if serving is None:
        services = every
    elif serving[0] == "worker":
        services = [s for s in every if s.record.worker == serving[1]]
    else:
        services = []  # the scheduler's /metrics, in a process that runs workers too
    name = "dask_worker_gpupool_"
    pool_bytes = GaugeMetricFamily(
        name + "pool_bytes",
        "Bytes this worker's pool reserves, by state: used (in live buffers), free (in none); the sum is the reserve.",
        labels=["worker", "state"],
    )
    limit = GaugeMetricFamily(
        name + "pool_limit_bytes", "The bound of this worker's pool (gpupool.max-size).", labels=["worker"]
    )
    leases = GaugeMetricFamily(name + "leases", "Live leases this worker granted to importers.", labels=["worker"])
    leased = GaugeMetricFamily(name + "leased_bytes", "Bytes kept alive by live leases.", labels=["worker"])
    mapped = GaugeMetricFamily(name + "mapped_pools", "Peers' pools mapped by this worker.", labels=["worker"])
    handoffs = CounterMetricFamily(
        name + "handoffs",
        "Zero-copy handoffs, by direction (forward: an import passed on; return: a value taken back).",
        labels=["worker", "direction"],
    )
    received = CounterMetricFamily(name + "received_bytes", RECEIVED_HELP, labels=["worker", "path"])
    sent = CounterMetricFamily(name + "sent_copy_bytes", SENT_COPY_HELP, labels=["worker"])
    staged = CounterMetricFamily(
        name + "staged_bytes",
        "Bytes of arrays outside the pool copied into it on the GPU to be handed over (fallback staged-in-pool).",
        labels=["worker"],
    )
    quarantined = GaugeMetricFamily(
        name + "ucx_quarantined_bytes",
        "Device memory of UCX transfers that did not complete, kept out of reuse: a figure of the worker's process, "
        "served once per process (under its first worker with a pool).",
        labels=["worker"],
    )
    fallbacks = CounterMetricFamily(
        name + "fallbacks", "Same-host transfers copied instead of handed over, by reason.", labels=["worker", "reason"]
    )
    abandoned = CounterMetricFamily(
        name + "leases_abandoned", "Leases that ended unclaimed (their transfer failed).", labels=["worker"]
    )
    in_doubt = GaugeMetricFamily(
        name + "leases_in_doubt",
        "Leases claimed by a reply that failed, kept until the importer answers whether it holds them.",
        labels=["worker"],
    )
    segments = GaugeMetricFamily(
        name + "segments",
        "Segments of this worker's device pool, by state (held, retiring).",
        labels=["worker", "state"],
    )
    for s in services:
        pool = s.name  # the worker's name: a restarted worker continues its series
        st = s.pool.stats()
        h = s.handoff_stats()
        pool_bytes.add_metric([pool, "used"], st.used)
        pool_bytes.add_metric([pool, "free"], max(st.reserved - st.used, 0))
        limit.add_metric([pool], s.pool.max_size)
        leases.add_metric([pool], h["leases"])
        leased.add_metric([pool], h["lease_bytes"])
        mapped.add_metric([pool], h["mapped_pools"])
        handoffs.add_metric([pool, "export"], h["exports"])
        handoffs.add_metric([pool, "import"], h["imports"])
        handoffs.add_metric([pool, "forward"], h.get("forwards", 0))  # imports passed on as their exporter's memory
        handoffs.add_metric([pool, "return"], h.get("returns", 0))  # this pool's values that came back
        received.add_metric([pool, "zero-copy"], h["zero_copy_bytes"])
        received.add_metric([pool, "copy"], h["copied_bytes"])
        received.add_metric([pool, "device-frames"], h["device_frames_bytes"])
        received.add_metric([pool, "host-frames"], h.get("host_frames_bytes", 0))  # small CuPy arrays over UCX
        sent.add_metric([pool], h["copied_out_bytes"])
        staged.add_metric([pool], h.get("pool_staged_bytes", 0))
        if s is home:  # one figure for the whole process: once, or sums over its workers would count it again
            quarantined.add_metric([pool], h.get("ucx_quarantined_bytes", 0))
        for reason in FALLBACK_REASONS:
            fallbacks.add_metric([pool, reason], h["fallbacks"].get(reason, 0))
        abandoned.add_metric([pool], h["leases_abandoned"])
        in_doubt.add_metric([pool], h.get("leases_in_doubt", 0))
        segments.add_metric([pool, "held"], h["segments"])
        segments.add_metric([pool, "retiring"], h["segments_retiring"])
    yield from (pool_bytes, limit, leases, leased, mapped, handoffs, received, sent, staged, quarantined, fallbacks)
    yield from (abandoned, in_doubt, segments)


class _Collector:
    def __init__(self, collect: Callable[[], Iterator[Any]]) -> None:
        self._collect = collect

    def collect(self) -> Iterator[Any]:
        yield from self._collect()


def _register(key: str, collect: Callable[[], Iterator[Any]]) -> bool:
    try:
        import prometheus_client
    except ImportError:
        return False
    with _lock:
        if key not in _registered:
            prometheus_client.REGISTRY.register(_Collector(collect))
            _registered.add(key)
    return True


def register() -> bool:
    """Add the worker collector to this process's Prometheus registry (once); ``False`` without prometheus_client."""
    return _register("worker", _worker_metrics)


def register_scheduler(pools_by_kind: Callable[[], dict[str, int]]) -> bool:
    """Add the scheduler collector (once per process); ``pools_by_kind`` reads the live registry. The scheduler's
    ``/metrics`` serves it, and no worker series of this process (:func:`serving`).

    A later call (the plugin registered again) replaces the source.
    """
    global _scheduler_source
    _scheduler_source = pools_by_kind

    def collect() -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        serving = _SERVING.get()
        if serving is not None and serving[0] != "scheduler":
            return  # a worker's /metrics, in a process that runs the scheduler too
        g = GaugeMetricFamily("dask_scheduler_gpupool_pools", "Pools in the gpupool registry.", labels=["kind"])
        counts = _scheduler_source() if _scheduler_source is not None else {}
        for kind in ("device", "pinned", "host"):
            g.add_metric([kind], counts.get(kind, 0))
        yield g

    return _register("scheduler", collect)
