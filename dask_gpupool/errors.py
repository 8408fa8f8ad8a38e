"""The one exception hierarchy of dask_gpupool.

Every error raised on purpose by this package derives from
:class:`GPUPoolError` and from the builtin that matches its meaning, so code
that catches ``ValueError`` or ``ConnectionError`` keeps working::

    GPUPoolError(Exception)
    ├── ConfigError(GPUPoolError, ValueError)
    ├── ProtocolError(GPUPoolError, ValueError)
    ├── PoolUnavailableError(GPUPoolError, RuntimeError)
    ├── PoolClosedError(GPUPoolError, RuntimeError)
    ├── PoolExhaustedError(GPUPoolError, MemoryError)
    ├── UnknownPoolError(GPUPoolError, LookupError)
    ├── PeerAccessError(GPUPoolError, RuntimeError)
    ├── DataLostError(GPUPoolError, ConnectionError)
    └── BrokerError(GPUPoolError, ConnectionError)
        ├── PeerLostError(BrokerError)
        ├── BrokerRefusedError(BrokerError)
        └── NotAMemberError(BrokerError)

Two errors are kept apart on purpose: :class:`PoolClosedError` means *you*
closed it, :class:`PeerLostError` means the other side went away under you.
"""

from __future__ import annotations

__all__ = [
    "BrokerError",
    "BrokerRefusedError",
    "ConfigError",
    "DataLostError",
    "GPUPoolError",
    "NotAMemberError",
    "PeerAccessError",
    "PeerLostError",
    "PoolClosedError",
    "PoolExhaustedError",
    "PoolUnavailableError",
    "ProtocolError",
    "UnknownPoolError",
]


class GPUPoolError(Exception):
    """Base class of every error raised by dask_gpupool."""


class ConfigError(GPUPoolError, ValueError):
    """An option has a value that cannot be used.

    Raised when a :class:`~dask_gpupool.GPUPool` is built or when a worker sets
    its pool up. The message names the ``gpupool.*`` key and the valid values.
    """


class ProtocolError(GPUPoolError, ValueError):
    """A message that crossed a process boundary is malformed.

    Raised by ``from_msg`` of every wire message, and by the broker client when
    a reply is not what the protocol allows.
    """


class PoolUnavailableError(GPUPoolError, RuntimeError):
    """There is no pool here to use.

    Raised by :func:`~dask_gpupool.allocate` outside a worker that runs the
    plugin, and by calls that need the scheduler's registry when the
    scheduler has no ``gpupool`` plugin.
    """


class PoolClosedError(GPUPoolError, RuntimeError):
    """The pool (or the mapping of a peer's pool) was closed by its owner here."""


class PoolExhaustedError(MemoryError, GPUPoolError):
    """An allocation does not fit in the pool's ``max_size``.

    ``MemoryError`` comes first on purpose: the class then gets
    ``MemoryError``'s constructor, and tblib (how distributed sends a task's
    exception to the client) can rebuild it. The other order reached the
    client as a bare ``Exception`` (``MemoryError.__new__(PoolExhaustedError)
    is not safe``).
    """


class UnknownPoolError(GPUPoolError, LookupError):
    """No pool with this UUID is registered (or it has left the cluster)."""


class PeerAccessError(GPUPoolError, RuntimeError):
    """A peer's pool exists but cannot be mapped into this process.

    For example: it lives on another host, its kind does not match, or this
    process's GPU cannot be granted access to the GPU the pool lives on.
    """


class DataLostError(GPUPoolError, ConnectionError):
    """A handed-over value could not be received: its lease ended, its worker left or cannot be reached.

    Raised while deserializing a handoff, only after the fallback (asking the
    exporter for a host copy) failed too, and for any other failure to
    receive a value. The message names the pool and the worker that held the
    data. It is a ``ConnectionError`` on purpose: Dask treats it as a failed
    transfer and fetches the key again (the exporter then sends a copy) or
    has it recomputed, rather than leaving the dependent task waiting.
    """


class BrokerError(GPUPoolError, ConnectionError):
    """A request to a peer's fd broker failed."""


class PeerLostError(BrokerError):
    """The peer's broker could not be reached or closed the connection."""


class BrokerRefusedError(BrokerError):
    """The peer's broker answered, and refused the request."""


class NotAMemberError(BrokerError):
    """A broker refused a process that did not prove membership of its cluster.

    Brokers serve only processes of the same uid that present the cluster's
    token (handed to workers by the scheduler's registry); see docs/security.md.
    """
