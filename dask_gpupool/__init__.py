"""dask_gpupool: zero-copy handoff of GPU task results between Dask workers of one host.

Every worker gets an IPC-enabled memory pool (GPU, pinned host, or shared host
memory); the scheduler keeps a registry of pools keyed by UUID; same-host peers
map each other's pools through an fd broker. Start with::

    client.register_plugin(dask_gpupool.GPUPool())

or ``dask scheduler --preload dask_gpupool``.
"""

from __future__ import annotations

from dask_gpupool.config import PoolOptions
from dask_gpupool.dask.api import allocate, pool_stats, pools, stats, to_pool, trim
from dask_gpupool.dask.preload import dask_setup
from dask_gpupool.dask.registration import register_serializers
from dask_gpupool.dask.scheduler_plugin import GPUPool
from dask_gpupool.dask.views import as_array
from dask_gpupool.errors import (
    BrokerError,
    BrokerRefusedError,
    ConfigError,
    DataLostError,
    GPUPoolError,
    NotAMemberError,
    PeerAccessError,
    PeerLostError,
    PoolClosedError,
    PoolExhaustedError,
    PoolUnavailableError,
    ProtocolError,
    UnknownPoolError,
)
from dask_gpupool.wire.registry import PoolRecord

register_serializers()  # Dask's serializers for pool memory, in every process that imports the package

__version__ = "0.1.0"

__all__ = [
    "BrokerError",
    "BrokerRefusedError",
    "ConfigError",
    "DataLostError",
    "GPUPool",
    "GPUPoolError",
    "NotAMemberError",
    "PeerAccessError",
    "PeerLostError",
    "PoolClosedError",
    "PoolExhaustedError",
    "PoolOptions",
    "PoolRecord",
    "PoolUnavailableError",
    "ProtocolError",
    "UnknownPoolError",
    "allocate",
    "as_array",
    "dask_setup",
    "pool_stats",
    "pools",
    "stats",
    "to_pool",
    "trim",
]
