"""``client.run`` targets for the trust-boundary tests: headers an exporter made, and a read as from a member.

A client or a member that turns against the cluster sends what these make: the header of a real export (what a
pinned reply would have shown it), a stream header naming another copy server, a header read as if it came in a
member's ``get_data`` reply, a task result whose every reply carries a header that cannot be received
(:class:`Unreceivable`).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from dask_gpupool.dask.worker_plugin import service_of

if TYPE_CHECKING:
    from distributed import Worker

__all__ = [
    "Unreceivable",
    "allocate_in_task",
    "drop_read",
    "export_header",
    "read_as_reply_from",
    "revoke",
    "stream_header",
    "unreceivable",
]

#: The lease an :class:`Unreceivable`'s header names: far above any lease a worker grants in a test.
NEVER_GRANTED = 1 << 40


def export_header(key: str, importer: str, dask_worker: Worker) -> dict[str, Any]:
    """client.run target: the header of an IPC export of this worker's value of ``key`` to ``importer`` (its lease
    granted as a ``get_data`` reply would grant it)."""
    service = service_of(dask_worker)
    buf: Any = dask_worker.data[key]
    row = service.registry.worker_row(importer)
    assert row is not None, importer
    return service.exports.export_ipc(buf, buf, row, None).to_msg()


def stream_header(key: str, importer: str, address: str, dask_worker: Worker) -> dict[str, Any]:
    """client.run target: the header of a stream export of this worker's value of ``key`` to ``importer``, its
    copy server's address replaced by ``address`` (the leases are granted; they end unpulled at the lease timeout)."""
    service = service_of(dask_worker)
    buf: Any = dask_worker.data[key]
    row = service.registry.worker_row(importer)
    assert row is not None, importer
    header = service.exports.export_stream(buf, buf, 0, int(buf.size), row, None)
    return dataclasses.replace(header, address=address).to_msg()


def read_as_reply_from(sender: str, header: dict[str, Any], dask_worker: Worker) -> str:
    """client.run target: deserialize ``header`` as a Buffer as the worker's reads of a ``get_data`` reply from
    ``sender`` do (a member's reply, on a comm bound to it); keep the value (:func:`drop_read`). ``"Type: message"``
    of the error, or ``""``."""
    from cuda.core import Buffer
    from distributed.protocol import dask_deserialize

    from dask_gpupool.dask.dask_family import KEY
    from dask_gpupool.handoff.deferred import SENDER

    token = SENDER.set(sender)
    try:
        dask_worker._gpupool_read = dask_deserialize.dispatch(Buffer)({KEY: header}, [])  # type: ignore[attr-defined]
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    finally:
        SENDER.reset(token)
    return ""


def drop_read(dask_worker: Worker) -> None:
    """client.run target: drop what :func:`read_as_reply_from` kept."""
    dask_worker._gpupool_read = None  # type: ignore[attr-defined]


def revoke(leases: list[int], dask_worker: Worker) -> int:
    """client.run target: end ``leases`` of this worker's (granted by :func:`export_header` or
    :func:`stream_header` and never claimed); returns how many ended."""
    return service_of(dask_worker).leases.revoke(leases)[0]


def allocate_in_task(nbytes: int) -> int:
    """Task: allocate ``nbytes`` with :func:`dask_gpupool.allocate`, as a task does, and free it; returns ``nbytes``."""
    from dask_gpupool import allocate

    buf = allocate(nbytes)
    buf.close()
    return nbytes


class Unreceivable:
    """A member's task result whose every ``get_data`` reply fails at the receiver: its serializer (``"dask"``
    family) sends an ``ipc`` header of the member's own pool naming a lease (:data:`NEVER_GRANTED`) it never granted,
    claimed over its broker, which refuses it; its deserializer is the one of a pool Buffer
    (:func:`~dask_gpupool.dask.dask_family.buffer_from_header`). So every fetch ends in a
    :class:`~dask_gpupool.errors.DataLostError`, as a lying member's replies would."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes


def unreceivable(nbytes: int) -> Unreceivable:
    """Task: an :class:`Unreceivable` of ``nbytes`` (the member's result that no peer can receive)."""
    return Unreceivable(nbytes)


def _lying_header(x: Unreceivable) -> tuple[dict[str, Any], list[Any]]:
    from dask_gpupool.dask.dask_family import KEY
    from dask_gpupool.handoff.registry import active_service
    from dask_gpupool.wire.handoff import BufferDescriptor, HandoffHeader

    service = active_service()
    assert service is not None, "an Unreceivable is sent by a worker with a pool"
    desc = BufferDescriptor(pool=service.pool.uuid, size=x.nbytes)
    header = HandoffHeader("ipc", service.pool.kind, x.nbytes, service.record.worker, desc, NEVER_GRANTED)
    return {KEY: header.to_msg()}, []


def _received(header: dict[str, Any], frames: list[Any]) -> Any:
    from dask_gpupool.dask.dask_family import buffer_from_header

    return buffer_from_header(header, frames)


def _register() -> None:
    from distributed.protocol import dask_deserialize, dask_serialize

    dask_serialize.register(Unreceivable)(_lying_header)
    dask_deserialize.register(Unreceivable)(_received)


_register()
