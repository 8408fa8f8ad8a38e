"""Copies that land on the importing side (:class:`Copies`): a value that was not mapped.

Three ways a copy arrives: a host copy out of the exporter's memfd when an
import failed (:meth:`Copies.fetch_copy`), the bytes in Dask's frames
(:meth:`Copies.receive_copy`), or a streamed pull from the exporter's copy
server (:meth:`Copies.pull_copy`). Each lands in this worker's pool when the
pool fits where the value must be readable and has room, else in memory
outside it (fallback ``receiver-pool-full``), so that it can be handed on
zero-copy. The :class:`~dask_gpupool.handoff.importer.Importer` owns one.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from typing import TYPE_CHECKING, Any

from dask_gpupool.config import PoolOptions
from dask_gpupool.errors import DataLostError, GPUPoolError, NotAMemberError, PoolExhaustedError
from dask_gpupool.handoff.deferred import fill_later
from dask_gpupool.handoff.imported import Releaser
from dask_gpupool.handoff.links import ExporterLinks
from dask_gpupool.handoff.registry import RegistryView
from dask_gpupool.handoff.stats import HandoffStats
from dask_gpupool.memory.buffers import copy_from_host, host_buffer
from dask_gpupool.memory.pool import Pool
from dask_gpupool.memory.topology import current_gpu, local_devices
from dask_gpupool.transport.link import PeerLink
from dask_gpupool.wire.handoff import HandoffHeader
from dask_gpupool.wire.registry import PoolRecord

if TYPE_CHECKING:
    from cuda.core import Buffer

__all__ = ["Copies"]


class Copies:
    """Lands copies of handed-over values in one worker's pool (or outside it).

    Parameters
    ----------
    options : PoolOptions
    pool : Pool
        This worker's own pool: copies land in it.
    worker : str
        This worker's address (counters and warnings name it).
    registry : RegistryView
        This worker's copy of the registry (read only here).
    handoffs : HandoffStats
        The worker's counters (copied bytes, fallbacks).
    links : ExporterLinks
        The importer's links to exporters (memfd copies, claims, the cluster's token).
    releaser : Releaser
        Releases the lease of a memfd copy once it is done.
    """

    options: PoolOptions
    pool: Pool
    worker: str
    registry: RegistryView
    handoffs: HandoffStats
    links: ExporterLinks
    releaser: Releaser

    def __init__(
        self,
        options: PoolOptions,
        pool: Pool,
        worker: str,
        registry: RegistryView,
        handoffs: HandoffStats,
        links: ExporterLinks,
        releaser: Releaser,
    ) -> None:
        self.options = options
        self.pool = pool
        self.worker = worker
        self.registry = registry
        self.handoffs = handoffs
        self.links = links
        self.releaser = releaser

    def fetch_copy(self, header: HandoffHeader, record: PoolRecord, link: PeerLink) -> Buffer:
        """Ask the exporter for a host copy of a leased buffer and land it in this pool.

        Returns the landing Buffer (owned by the caller) at once; the copy out
        of the exporter's memfd fills it through :func:`~dask_gpupool.handoff.deferred.fill_later`,
        which closes the fd and releases the lease when done or abandoned.
        """
        try:
            self.links.claim(record, link, [header.lease])  # ours now: only this worker may release it
        except GPUPoolError as e:
            raise DataLostError(
                f"lease {header.lease} on pool {record.pool} of worker {record.worker} cannot be read: {e}"
            ) from e
        try:
            reply, fd = self.links.link(record).fetch_copy(header.lease)
        except GPUPoolError as e:
            self.releaser.put(record.broker, header.lease, unmapped=True)  # claimed, never mapped: give it back
            raise DataLostError(
                f"lease {header.lease} on pool {record.pool} of worker {record.worker} cannot be read: {e}"
            ) from e
        ended: list[bool] = []

        def end() -> None:
            if not ended:
                ended.append(True)
                os.close(fd)
                self.releaser.put(record.broker, header.lease)

        if reply.size != header.nbytes:  # another buffer's copy, or a lie: never a value of another size
            end()
            raise DataLostError(
                f"lease {header.lease} on pool {record.pool} of worker {record.worker}: its copy holds "
                f"{reply.size} bytes, the header says {header.nbytes}"
            )
        try:
            buf = self.landing(reply.size, record.worker, "any")
        except BaseException:
            end()
            raise

        def copy() -> None:
            with mmap.mmap(fd, reply.size, prot=mmap.PROT_READ) if reply.size else contextlib.nullcontext(b"") as m:
                copy_from_host(buf, memoryview(m))
            end()
            self.handoffs.add(copied_bytes=reply.size)

        def abandon() -> None:
            buf.close()
            end()

        fill_later(copy, abandon)
        return buf

    def receive_copy(self, kind: str, data: Any, sender: str, need: str = "any") -> Buffer:
        """Land a host copy in this worker's pool (so it can be handed on zero-copy).

        Parameters
        ----------
        kind : str
            Where the data lived at the sender.
        data : bytes-like
            The bytes.
        sender : str
            The sender's address (for stats and warnings).
        need : {"any", "host", "device"}
            Where the value must be readable (a NumPy array needs host memory,
            a CuPy array GPU-accessible memory). A pool that does not fit is
            passed over for memory outside it.

        When the pool is full the bytes go to memory outside it (GPU memory for
        ``device`` pools, host memory otherwise), counted as fallback
        ``receiver-pool-full``.
        """
        view = memoryview(data).cast("B")
        n = view.nbytes
        buf = self.landing(n, sender, need)
        copy_from_host(buf, view)
        self.handoffs.add(copied_bytes=n)
        return buf

    def pull_copy(self, header: HandoffHeader, need: str = "any") -> Buffer:
        """Pull a ``stream`` handoff from the exporter's copy server (the address its registry row names, whatever
        the header says) into this worker's pool.

        Lands like :meth:`receive_copy`. Returns a Buffer owned by the caller,
        filled by the pull through :func:`~dask_gpupool.handoff.deferred.fill_later`:
        at once (blocking), or by the caller that collects fills, in a thread.

        Raises
        ------
        DataLostError
            If the exporter left, refused (lease ended) or the transfer broke;
            names lease, pool and worker.
        """
        assert header.path == "stream"
        record = self.registry.worker_row(header.exporter)
        if record is None:
            raise DataLostError(
                f"worker {header.exporter} is not registered (it left?); lease {header.lease} cannot be pulled"
            )
        if not record.copier:
            raise DataLostError(f"worker {header.exporter} runs no copy server; lease {header.lease} cannot be pulled")
        if self.links.token is None:
            raise NotAMemberError(f"pool {self.pool.uuid}: not registered with the scheduler yet (no cluster token)")
        buf = self.landing(header.nbytes, header.exporter, need)
        leases, token = [header.lease, *header.lanes], self.links.token

        def copy() -> None:
            from dask_gpupool.transport.pull import pull  # loaded by the first pull

            # the exporter's own copy server as its registry row names it: never an address a header names
            pull(record.copier, record.pool, leases, token, self.worker, buf, self.options.broker_timeout)
            self.handoffs.add(copied_bytes=header.nbytes, streamed_bytes=header.nbytes)

        fill_later(copy, buf.close)  # a lease not pulled ends at the exporter (at its timeout or the hang-up)
        return buf

    def landing(self, n: int, sender: str, need: str = "any") -> Buffer:
        """Memory for a copy of ``n`` bytes from ``sender`` (owned by the caller): this pool if it fits ``need`` and
        has room, else outside it (fallback ``receiver-pool-full`` when the pool was full)."""
        fits = (
            need == "any"
            or (need == "host" and self.pool.kind != "device")
            or (need == "device" and self.pool.kind != "host")
        )
        if not fits:
            return _outside_pool(self.pool, n, need)
        try:
            return self.pool.allocate(n)
        except PoolExhaustedError as e:
            self.handoffs.fallback(sender, "receiver-pool-full", self.worker, str(e))
            return _outside_pool(self.pool, n, need)


def _outside_pool(pool: Pool, nbytes: int, need: str = "any") -> Buffer:
    """Memory for a copy that this worker's pool cannot take: GPU memory for a GPU pool (or a CuPy
    array), host memory otherwise."""
    device = pool.device if pool.device is not None else (0 if local_devices() else None)
    if device is not None and (need == "device" or (need == "any" and pool.kind == "device")):
        dev = current_gpu(device)
        return dev.memory_resource.allocate(nbytes, stream=dev.default_stream)
    return host_buffer(bytearray(nbytes))
