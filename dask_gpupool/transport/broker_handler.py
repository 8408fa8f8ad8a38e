"""What a broker asks its owner (:class:`BrokerHandler`), and a handler that only serves pool fds.

The worker's handler is :class:`~dask_gpupool.handoff.exporter.ExportSide`:
its pool's fd, VMM segment fds, its leases and copies of them. Tests and
tools that need only the fd exchange pass a :data:`PoolLookup` to
:class:`~dask_gpupool.transport.broker.FdBroker`, which wraps it in
:class:`LookupOnly`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Protocol

from dask_gpupool.errors import UnknownPoolError
from dask_gpupool.wire.broker import HandleReply

__all__ = ["BrokerHandler", "LookupOnly", "PoolLookup"]

#: Returns ``(fd, reply)`` for a pool this broker serves, else ``None``. The fd stays owned by the pool.
PoolLookup = Callable[[str], "tuple[int, HandleReply] | None"]


class BrokerHandler(Protocol):
    """What a broker asks its owner. Every method runs on the broker's thread
    (``copy_out`` on a helper thread) and must not block for long.

    ``importer`` is the worker address a connection named in its
    :class:`~dask_gpupool.wire.broker.Hello`, accepted by :meth:`identify`;
    ``""`` for connections that only fetch pool fds.
    """

    def thread_started(self) -> None:
        """Called once on the broker's thread before it serves anything."""

    def identify(self, importer: str, pid: int) -> bool:
        """Whether process ``pid`` (``SO_PEERCRED``; 0 when not visible here) may act for worker ``importer``."""

    def pool_handle(self, pool: str) -> tuple[int, HandleReply] | None:
        """``(fd, reply)`` for a pool this broker serves, else ``None``. The fd stays the pool's."""

    def segment_handle(self, pool: str, segment: int, importer: str) -> tuple[int, HandleReply]:
        """``(fd, reply)`` for VMM segment ``segment`` of ``pool``; the **broker closes the fd** after sending.

        Raises a :class:`~dask_gpupool.GPUPoolError` for an unknown pool or segment.
        """

    def claim(self, leases: Iterable[int], importer: str) -> list[int]:
        """``importer`` imported these leased buffers; return the ids refused."""

    def release(self, leases: Iterable[int], importer: str, unmapped: bool = False) -> None:
        """``importer`` closed its imports of these leased buffers (``unmapped``: it never mapped them)."""

    def transfer_failed(self, importer: str) -> None:
        """A transfer to ``importer`` failed after it claimed its leases: send it copies for a while."""

    def resync(self, leases: set[int], importer: str, epoch: int = 0) -> int:
        """``importer`` holds exactly ``leases`` (after a broken link); return how many others ended.

        ``epoch``: the importer's snapshot number (0: not known); an older one than the newest applied is
        ignored.
        """

    def segments_released(self, segments: tuple[tuple[int, int], ...], importer: str) -> None:
        """``importer`` unmapped these retiring segments ``(id, claims)``."""

    def forward(self, lease: int, importer: str, to: str) -> tuple[int, int]:
        """Grant worker ``to`` a lease on what ``importer``'s lease ``lease`` keeps alive: ``(lease, segment)``.

        Raises a :class:`~dask_gpupool.GPUPoolError` when ``lease`` is not a
        claimed IPC lease of ``importer`` or ``to`` is not a worker of this host.
        """

    def settle_forwarded(self, leases: Iterable[int], importer: str) -> None:
        """The replies of ``importer`` that carried these forwarded leases ended: end the unclaimed ones."""

    def importer_exited(self, importer: str) -> None:
        """``importer``'s process is gone: release everything it held."""

    def copy_out(self, lease: int, importer: str) -> tuple[int, int]:
        """``(memfd, size)`` holding a copy of a leased buffer of ``importer``; the broker closes the memfd.

        Raises a :class:`~dask_gpupool.GPUPoolError` when the lease is gone, or
        a :class:`~dask_gpupool.BrokerRefusedError` when no memfd can be made
        now (no fd left): either is that request's answer, and the connection
        serves on. Makes no fd when it raises.
        """

    def tick(self) -> None:
        """Called about once a second (logs leases unclaimed for long)."""


class LookupOnly:
    """A :class:`BrokerHandler` that serves pool fds and nothing else."""

    def __init__(self, lookup: PoolLookup) -> None:
        self._lookup = lookup

    def thread_started(self) -> None:
        pass

    def identify(self, importer: str, pid: int) -> bool:
        return True

    def pool_handle(self, pool: str) -> tuple[int, HandleReply] | None:
        return self._lookup(pool)

    def segment_handle(self, pool: str, segment: int, importer: str) -> tuple[int, HandleReply]:
        raise UnknownPoolError(f"pool {pool}: this broker serves pool handles only")

    def claim(self, leases: Iterable[int], importer: str) -> list[int]:
        return list(leases)

    def release(self, leases: Iterable[int], importer: str, unmapped: bool = False) -> None:
        pass

    def transfer_failed(self, importer: str) -> None:
        pass

    def resync(self, leases: set[int], importer: str, epoch: int = 0) -> int:
        return 0

    def segments_released(self, segments: tuple[tuple[int, int], ...], importer: str) -> None:
        pass

    def forward(self, lease: int, importer: str, to: str) -> tuple[int, int]:
        raise UnknownPoolError("this broker serves no leases")

    def settle_forwarded(self, leases: Iterable[int], importer: str) -> None:
        pass

    def importer_exited(self, importer: str) -> None:
        pass

    def copy_out(self, lease: int, importer: str) -> tuple[int, int]:
        raise UnknownPoolError("this broker serves no leases")

    def tick(self) -> None:
        pass
