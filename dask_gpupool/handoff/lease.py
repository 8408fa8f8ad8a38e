"""A lease: one exported buffer kept alive for one importer, and when it ends (:class:`Lease`).

When a worker hands a buffer of its pool to a same-host peer as an IPC
descriptor, it first *grants a lease*: its
:class:`~dask_gpupool.handoff.leases.LeaseTable` keeps a strong
reference to the buffer (or the array that holds it), independent of
``worker.data``. Dask releasing the key, the Active Memory Manager dropping
this replica, or a retire therefore cannot free memory a peer maps: the
buffer goes back to the pool only when its lease ends.

Why this is not optional: a peer that reads an allocation its owner freed
reads whatever reuses the memory (same GPU), or kills its own CUDA context
with ``CUDA_ERROR_CONTAINED`` (other GPU), see ``docs/reliability.md``.

**A lease ends only when its importer is known to be done with it.** That is
when

- the importer releases it (a :class:`~dask_gpupool.wire.broker_leases.LeaseRelease`
  from that worker, after it closed its import), or leaves it out of a
  :class:`~dask_gpupool.wire.broker_leases.Resync` after a broken link;
- the importer is known dead: its process exited (the broker watches it with
  a pidfd from its first connection, or from when it left the registry by its
  row's pid). Leaving the registry is not dying: the scheduler removes
  workers whose process lives on (``worker-ttl`` after a stall), and their
  tasks still read what they imported. Only an importer whose process cannot
  be watched (another pid namespace, no pidfds) is released when it leaves;
- it was never claimed and the ``get_data`` reply that carried it has
  ended (:meth:`LeaseTable.settle` for a stream lease no pull
  claimed, :meth:`LeaseTable.settle_forwarded` for a lease another worker
  forwarded): the importer sends its ``"OK"`` only after its claims were
  acknowledged, so a lease still unclaimed then will never be used; a reply
  that failed is never used either, because a claim that arrives after the
  lease ended is refused and the importer never hands out memory whose claim
  was refused. A lease claimed by the reply (below) ends unheld only once
  its importer said it does not hold it (:meth:`LeaseTable.resolve`).

Two ways to claim:

- by the reply (the leases of this worker's own buffers, ``claim="reply"``
  in their header, their memory written before the export): the importer
  holds the lease from the moment it deserializes the header
  (:meth:`HeldLeases.hold_here <dask_gpupool.handoff.held.HeldLeases.hold_here>`),
  with no round trip. The exporter learns it from the reply: Dask's
  ``"OK"``, which the importer sends only after deserializing, marks the
  reply's leases claimed (:meth:`LeaseTable.settle` with ``ok``). When the
  reply failed instead, the exporter cannot tell whether the importer got
  the leases, so it ends none of them on its own: they are *in doubt* until
  the importer answers a query (Dask's own comm,
  :class:`~dask_gpupool.wire.handoff.LeaseQuery`). The importer answers which
  it holds and, atomically, refuses for good the others
  (:meth:`HeldLeases.answer <dask_gpupool.handoff.held.HeldLeases.answer>`),
  so a header deserialized later can no longer hold them
  (:meth:`LeaseTable.resolve`). An importer that never answers keeps them until
  it dies or leaves, as for any lease.
- over the broker: the importer claims over the exporter's broker and waits
  for the answer before it reads (a round trip per reply and exporter). So
  are leases another worker forwarded (:meth:`LeaseTable.forward`), and
  leases of the first kind that the importer receives while a resync of its
  link to this worker is open.

No timer ends a lease, and a broker connection closing does not either (a
link can break while its importer lives: an exporter stalled past
``broker-timeout``). Unclaimed leases are therefore bounded by Dask's
in-flight ``get_data`` replies (``distributed.worker.connections.outgoing``
per worker); ``lease-timeout`` only logs leases that stay unclaimed that long.

(``LeaseTable`` is :class:`dask_gpupool.handoff.leases.LeaseTable`, which
keeps the leases of one exporter and applies these rules.)

Lease ids are random 62-bit numbers, scoped to their importer: a claim or a
release names leases, and only those granted to the worker on the other end
of that connection are affected.
"""

from __future__ import annotations

import secrets
from collections.abc import Container
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Lease", "new_lease_id"]


def new_lease_id(taken: Container[int]) -> int:
    """A lease id: random, positive, 62 bits, not in ``taken`` (the live ids of its table)."""
    while True:
        lease_id = secrets.randbits(62) + 1
        if lease_id not in taken:
            return lease_id


@dataclass
class Lease:
    """One exported buffer, kept alive for one importer.

    Attributes
    ----------
    id : int
        Sent in the handoff header; positive, random.
    holder : object
        The strong reference: the exported Buffer or the array over it.
    nbytes : int
        Bytes of the buffer.
    importer : str
        Address of the worker it was granted to; only that worker may claim
        or release it.
    granted : float
        ``time.monotonic()`` at grant.
    claimed : bool
        The importer acknowledged it (IPC leases over the broker; stream
        leases once the copy server started the pull).
    connection : int or None
        The copy-server connection pulling a stream lease; ``None`` for IPC leases.
    segment : int
        Id of the segment the buffer lies in (0: none); a claim tells the
        segment which importer maps it (:mod:`dask_gpupool.memory.segments`).
    warned : bool
        Logged once as unclaimed for longer than ``timeout``.
    forwarder : str
        The worker that asked for this lease on the importer's behalf
        (:meth:`LeaseTable.forward`: it passed on a value it had imported);
        ``""`` for leases granted by this worker's own serializers.
    by_reply : bool
        Claimed by the reply (the IPC leases of this worker's own buffers):
        the importer holds it once it deserialized the header; its segment
        was noted at the grant, and is forgotten if the lease ends unheld.
    in_doubt : bool
        A ``by_reply`` lease whose reply failed: kept until the importer
        says whether it holds it (:meth:`LeaseTable.resolve`).
    unmapped : bool
        The importer asked for a copy instead of mapping it
        (:meth:`LeaseTable.copied_instead`): its segment claim was taken back.
    """

    id: int
    holder: Any = field(repr=False)
    nbytes: int
    importer: str
    granted: float
    claimed: bool = False
    connection: int | None = None
    segment: int = 0
    warned: bool = False
    forwarder: str = ""
    by_reply: bool = False
    in_doubt: bool = False
    unmapped: bool = False
