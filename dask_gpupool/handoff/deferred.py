"""Copies a deserializer lands later, in a thread, so that Dask's event loop keeps running.

A deserializer must return the value, and Dask runs it on the event loop for
small messages: a handoff header is a few hundred bytes even when the copy it
names, a streamed pull (:meth:`Copies.pull_copy
<dask_gpupool.handoff.copies.Copies.pull_copy>`) or a copy out of an
exporter's memfd (:meth:`Copies.fetch_copy
<dask_gpupool.handoff.copies.Copies.fetch_copy>`), moves 8 GiB (about
1.5 s). So the importer allocates the landing buffer, returns it at once, and
hands the copy that fills it to :func:`fill_later`. Inside :func:`collecting`
(the worker's comm read, :func:`dask_gpupool.dask.worker_internals.fill_after_read`)
the copy waits in the collector until the caller runs :func:`run_fills` in a
thread, before anyone sees the message. Outside it, the copy runs at once.

Claims wait the same way (:func:`claim_later`): a mapped buffer must not be
read before its exporter acknowledged the lease, and that acknowledgement is
a round trip to the exporter's broker (0.7 ms on a 2-vCPU container). Inside
:func:`collecting` the claims of one message wait, grouped by exporter, and
run first when the caller runs the fills: one round trip per exporter for a
reply of several values, off the event loop, before anyone sees the message.

Ownership: a :class:`Fill` owns its landing buffer until it has run. When a
fill is abandoned (its copy failed, or one before it did), ``abandon`` closes
the buffer and gives back what the copy held (a lease, an fd).

A fill that fails after the message's claims ran fails the transfer, and Dask
asks again; the exporters whose leases were claimed would hand the same
values over again. So each claim batch that ran is told (``given_up``: the
importer sends the exporter
:class:`~dask_gpupool.wire.broker_leases.TransferFailed`, and the exporter
sends copies for a while), and a fill that fails every time cannot fail every
retry.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass

__all__ = ["Fill", "abandon_all", "claim_later", "collecting", "fill_later", "run_fills"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Fill:
    """A copy into a buffer already handed to the caller, and how to give it up.

    ``run`` fills the buffer (blocking, any thread) and ends what the copy
    held; ``abandon`` closes the buffer and ends what the copy held, once,
    when ``run`` failed or will not run. ``given_up``, when set, is called
    once when ``run`` succeeded but a later fill of the same message failed
    (a claim batch tells its exporter; errors are logged, not raised).
    """

    run: Callable[[], None]
    abandon: Callable[[], None]
    given_up: Callable[[], None] | None = None


class _Claims:
    """The leases of one exporter claimed in one message, and how to give up their buffers."""

    __slots__ = ("abandons", "claim", "given_up", "leases")

    def __init__(self, claim: Callable[[list[int]], None], given_up: Callable[[], None] | None) -> None:
        self.claim = claim
        self.given_up = given_up
        self.leases: list[int] = []
        self.abandons: list[Callable[[], None]] = []

    def fill(self) -> Fill:
        leases, abandons = list(self.leases), list(self.abandons)

        def abandon() -> None:
            for give_up in abandons:
                give_up()

        return Fill(lambda: self.claim(leases), abandon, self.given_up)


class _Collector:
    """The fills and claims left in one :func:`collecting` block; closed when the block is left."""

    __slots__ = ("claims", "fills", "open")

    def __init__(self) -> None:
        self.fills: list[Fill] = []
        self.claims: dict[str, _Claims] = {}
        self.open = True


_PENDING: contextvars.ContextVar[_Collector | None] = contextvars.ContextVar("gpupool_pending_fills", default=None)


def fill_later(run: Callable[[], None], abandon: Callable[[], None]) -> None:
    """Run ``run`` now, or leave it to the :func:`collecting` caller if there is one.

    When ``run`` raises here, ``abandon`` runs and the error propagates.
    """
    collector = _PENDING.get()
    if collector is not None and collector.open:
        collector.fills.append(Fill(run, abandon))
        return
    run_fills([Fill(run, abandon)])


def claim_later(
    exporter: str,
    lease: int,
    claim: Callable[[list[int]], None],
    abandon: Callable[[], None],
    given_up: Callable[[], None] | None = None,
) -> None:
    """Claim ``lease`` now (``claim([lease])``), or with the other leases of ``exporter`` left in this
    :func:`collecting` block, before its fills.

    ``claim`` blocks until the exporter holds every lease it is given, and
    raises if one was refused; ``abandon`` closes the buffer mapped under
    ``lease``. When the claim raises here, ``abandon`` runs and the error
    propagates. ``given_up`` tells the exporter that the transfer failed
    after the claim (a later fill failed). (``claim`` and ``given_up`` are
    the first call's for the exporter: the block's claims of one exporter
    share them.)
    """
    collector = _PENDING.get()
    if collector is not None and collector.open:
        batch = collector.claims.get(exporter)
        if batch is None:
            batch = collector.claims[exporter] = _Claims(claim, given_up)
        batch.leases.append(lease)
        batch.abandons.append(abandon)
        return
    run_fills([Fill(lambda: claim([lease]), abandon)])


@contextlib.contextmanager
def collecting() -> Iterator[list[Fill]]:
    """Collect the fills deserializers leave in this context (and the threads it is copied to).

    Yields a list that holds the fills once the block is left, the claims
    first (one fill per exporter). The caller runs them with
    :func:`run_fills` (in a thread) or abandons them. Tasks and
    callbacks started inside the block keep a copy of the context, and so of
    the collector, for as long as they live: the collector is closed and
    emptied on leaving, so it keeps nothing alive, and a fill left in it later
    runs at once.
    """
    collector = _Collector()
    fills: list[Fill] = []
    token = _PENDING.set(collector)
    try:
        yield fills
    finally:
        _PENDING.reset(token)
        collector.open = False
        fills.extend(batch.fill() for batch in collector.claims.values())
        fills.extend(collector.fills)
        collector.fills.clear()
        collector.claims.clear()


def run_fills(fills: list[Fill]) -> None:
    """Run ``fills`` in order; after the first failure abandon the rest, then raise it. Blocking.

    When the failure was a copy (a fill without ``given_up``), the claim
    batches that ran are told (``given_up``). A refused claim tells no one:
    its exporter ends the unclaimed leases when the reply ends and sends copies
    then, and the other exporters' values will hand over fine on Dask's retry.
    """
    error: BaseException | None = None
    failed: Fill | None = None
    ran: list[Fill] = []
    for fill in fills:
        if error is not None:
            fill.abandon()
            continue
        try:
            fill.run()
            ran.append(fill)
        except BaseException as e:
            error, failed = e, fill
            fill.abandon()
    if error is not None:
        for fill in ran if failed is not None and failed.given_up is None else ():
            if fill.given_up is not None:
                try:
                    fill.given_up()
                except Exception:
                    logger.warning("telling an exporter that a transfer failed did not work", exc_info=True)
        raise error


def abandon_all(fills: list[Fill]) -> None:
    """Give up every fill (the message they belong to was never delivered)."""
    for fill in fills:
        fill.abandon()
