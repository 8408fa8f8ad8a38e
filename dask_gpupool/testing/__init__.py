"""Helpers that tests and benchmarks run inside worker processes.

Kept in the package (like ``distributed.utils_test``) so that spawned Nanny
workers can import them by name. Nothing here is used by the library itself
(``tests/test_package.py`` checks). By kind:

- :mod:`~dask_gpupool.testing.memory`: reading and writing pool memory;
- :mod:`~dask_gpupool.testing.tasks`: tasks whose values travel through Dask;
- :mod:`~dask_gpupool.testing.probes`: ``client.run`` targets that look into a worker;
- :mod:`~dask_gpupool.testing.faults`: fault injection for the lease tests.

Everything is importable from here (``from dask_gpupool import testing as T``).
"""

from __future__ import annotations

from dask_gpupool.testing.faults import (
    block_imports,
    close_links,
    forget_pool,
    hide_broker,
    report_failed_transfer,
    restore_broker,
    stop_copy_server,
)
from dask_gpupool.testing.memory import (
    held_count,
    hold,
    make_cuda_context,
    map_peer,
    read_bytes,
    read_bytes_of,
    read_peer,
    read_peer_on_gpu,
    release,
    unmap,
    visible_devices,
    write_bytes,
)
from dask_gpupool.testing.probes import (
    deserialize_headers,
    grant_unclaimed_lease,
    handoff_counters,
    has_cluster_token,
    known_pools,
    last_transfer,
    lease_counts,
    mapped_segments,
    open_fds,
    resources,
    serialized_inline,
    socket_peers,
    start_loop_ticks,
    stop_loop_ticks,
)
from dask_gpupool.testing.tasks import (
    LAYOUTS,
    all_equal,
    as_nested_list,
    check_device_object,
    describe,
    device_object,
    every_other,
    fill,
    head,
    keep,
    make_array,
    make_buffer,
    overwrite,
    plain_cupy,
    scribble,
    scribble_all,
    serializer_families,
    set_all,
    slow_fill,
    total,
    try_write,
    view_of,
)

__all__ = [
    "LAYOUTS",
    "all_equal",
    "as_nested_list",
    "block_imports",
    "check_device_object",
    "close_links",
    "describe",
    "deserialize_headers",
    "device_object",
    "every_other",
    "fill",
    "forget_pool",
    "grant_unclaimed_lease",
    "handoff_counters",
    "has_cluster_token",
    "head",
    "held_count",
    "hide_broker",
    "hold",
    "keep",
    "known_pools",
    "last_transfer",
    "lease_counts",
    "make_array",
    "make_buffer",
    "make_cuda_context",
    "map_peer",
    "mapped_segments",
    "open_fds",
    "overwrite",
    "plain_cupy",
    "read_bytes",
    "read_bytes_of",
    "read_peer",
    "read_peer_on_gpu",
    "release",
    "report_failed_transfer",
    "resources",
    "restore_broker",
    "scribble",
    "scribble_all",
    "serialized_inline",
    "serializer_families",
    "set_all",
    "slow_fill",
    "socket_peers",
    "start_loop_ticks",
    "stop_copy_server",
    "stop_loop_ticks",
    "total",
    "try_write",
    "unmap",
    "view_of",
    "visible_devices",
    "write_bytes",
]
