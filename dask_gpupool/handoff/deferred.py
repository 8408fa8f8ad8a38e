"""Copies a deserializer lands later, in a thread, so that Dask's event loop keeps running.

A deserializer must return the value, and Dask runs it on the event loop for
small messages: a handoff header is a few hundred bytes even when the copy it
names, a streamed pull (:meth:`Copies.pull_copy
<dask_gpupool.handoff.copies.Copies.pull_copy>`) or a copy out of an
exporter's memfd (:meth:`Copies.fetch_copy
<dask_gpupool.handoff.copies.Copies.fetch_copy>`), moves 8 GiB (about
1.5 s). So the importer allocates the landing buffer, returns it at once, and
hands the copy that fills it to :func:`fill_later`. Inside :func:`collecting`
(the worker's comm read, :func:`dask_gpupool.dask.comms.read_then_fill`)
the copy waits in the collector until the caller runs :func:`run_fills` in a
thread, before anyone sees the message. Outside it, the copy runs at once.

Claims over the broker (a forwarded value's lease, or one received while a
resync with its exporter is open; the others are held by their reply) wait
the same way (:func:`claim_later`): such a mapped buffer must not be read
before its exporter acknowledged the lease, and that acknowledgement is a
round trip to the exporter's broker (0.7 ms on a 2-vCPU container). Inside
:func:`collecting` the claims of one message wait, grouped by exporter, and
run first when the caller runs the fills: one round trip per exporter for a
reply of several values, off the event loop, before anyone sees the message.

Ownership: a :class:`Fill` owns its landing buffer until it has run. When a
fill is abandoned (its copy failed, or one before it did), ``abandon`` closes
the buffer and gives back what the copy held (a lease, an fd).

Values wait the same way (:func:`make_later`): a deserializer that may read
the memory it was given (a cuDF column's may) must not run before the claims.
Inside :func:`collecting` it leaves a :class:`Later` in the message and a fill
that makes the value; the caller puts the values in place with :func:`resolve`
once the fills ran.

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
from typing import Any

__all__ = [
    "SENDER",
    "Fill",
    "Fills",
    "Later",
    "abandon_all",
    "claim_later",
    "collecting",
    "fill_later",
    "make_later",
    "resolve",
    "run_fills",
]

logger = logging.getLogger(__name__)


#: The worker whose message is being read here (the address this worker connected to), set by the comm read
#: wrapper (:func:`dask_gpupool.dask.comms.read_then_fill`); ``None`` when not known. The deserializers
#: read it and pass it on (:meth:`Importer.import_handoff <dask_gpupool.handoff.importer.Importer.import_handoff>`'s
#: ``sender``). A context variable rather than a parameter because Dask calls deserializers with a header and frames
#: only: the comm read reaches them through the context it runs them in. Per message read, not per process.
SENDER: contextvars.ContextVar[str | None] = contextvars.ContextVar("gpupool_sender", default=None)


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


class Later:
    """A value a fill makes (:func:`make_later`): it stands in a message until :func:`resolve` puts the value there."""

    __slots__ = ("made", "value")

    def __init__(self) -> None:
        self.made = False
        self.value: Any = None


class Fills(list[Fill]):
    """What one :func:`collecting` block left: its fills (the claims first) and the :class:`Later` values they make."""

    laters: list[Later]

    def __init__(self) -> None:
        super().__init__()
        self.laters = []


class _Collector:
    """The fills and claims left in one :func:`collecting` block; closed when the block is left."""

    __slots__ = ("claims", "fills", "laters", "open")

    def __init__(self) -> None:
        self.fills: list[Fill] = []
        self.claims: dict[str, _Claims] = {}
        self.laters: list[Later] = []
        self.open = True


#: The collector of the :func:`collecting` block this context runs in (``None``: outside one, fills run at once). A
#: context variable rather than a parameter for the same reason as :data:`SENDER`: the fills are left by
#: deserializers, which Dask calls with a header and frames only, several calls below the comm read that collects
#: them. Per message read, not per process.
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


def make_later(make: Callable[[], Any], abandon: Callable[[], None]) -> Any:
    """``make()`` now, or, inside :func:`collecting`, a :class:`Later` that a fill sets once the block's claims and
    earlier fills ran.

    For deserializers that may read the memory of the imports they were
    given. ``abandon`` drops what ``make`` would have used (the imports), when
    the fill will not run. Errors of ``make()`` propagate (here, or from
    :func:`run_fills`).
    """
    collector = _PENDING.get()
    if collector is None or not collector.open:
        return make()
    later = Later()

    def run() -> None:
        later.value = make()
        later.made = True

    collector.fills.append(Fill(run, abandon))
    collector.laters.append(later)
    return later


def resolve(msg: Any, laters: list[Later]) -> Any:
    """``msg`` with each of ``laters`` replaced by its value, in dicts, lists, tuples and sets at any depth.

    The caller calls it only when the block left :class:`Later` values
    (``Fills.laters``), after :func:`run_fills` ran them, off the event loop:
    it walks ``msg``'s containers until it has found every value (each
    container once, so shared and self-referencing ones are fine), and
    rebuilds only the containers that held one. Each placeholder stands in
    one place, as each deserialized object does.

    Raises
    ------
    RuntimeError
        When a value was not made yet, or is not in ``msg``.
    """
    wanted = {id(later) for later in laters}
    for later in laters:
        if not later.made:
            raise RuntimeError("resolve() before the fill that makes a value ran")
    found: set[int] = set()
    seen: set[int] = set()

    def walk(x: Any) -> Any:
        if isinstance(x, Later):
            if id(x) in wanted:
                found.add(id(x))
                return x.value
            return x
        kind = type(x)
        if kind not in (dict, list, tuple, set) or id(x) in seen:
            return x
        seen.add(id(x))
        if kind is dict:
            changed: dict[Any, Any] = {}
            for k, v in x.items():
                if len(found) == len(wanted):
                    break
                new = walk(v)
                if new is not v:
                    changed[k] = new
            return {**x, **changed} if changed else x
        items: list[Any] | None = None
        for i, v in enumerate(x):
            if len(found) == len(wanted):
                break
            new = walk(v)
            if new is not v:
                if items is None:
                    items = list(x)
                items[i] = new
        if items is None:
            return x
        return items if kind is list else kind(items)

    out = walk(msg)
    if len(found) != len(wanted):
        raise RuntimeError(f"{len(wanted) - len(found)} value(s) made later are not in the message's collections")
    return out


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
def collecting() -> Iterator[Fills]:
    """Collect the fills deserializers leave in this context (and the threads it is copied to).

    Yields a :class:`Fills` list that holds the fills once the block is
    left, the claims first (one fill per exporter), and the :class:`Later`
    values they make. The caller runs them with :func:`run_fills` (in a
    thread), then :func:`resolve` s the values, or abandons them. Tasks and
    callbacks started inside the block keep a copy of the context, and so of
    the collector, for as long as they live: the collector is closed and
    emptied on leaving, so it keeps nothing alive, and a fill left in it later
    runs at once.
    """
    collector = _Collector()
    fills = Fills()
    token = _PENDING.set(collector)
    try:
        yield fills
    finally:
        _PENDING.reset(token)
        collector.open = False
        fills.extend(batch.fill() for batch in collector.claims.values())
        fills.extend(collector.fills)
        fills.laters.extend(collector.laters)
        collector.fills.clear()
        collector.claims.clear()
        collector.laters.clear()


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
            _abandon(fill)
            continue
        try:
            fill.run()
            ran.append(fill)
        except BaseException as e:
            error, failed = e, fill
            _abandon(fill)
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
        _abandon(fill)


def _abandon(fill: Fill) -> None:
    """``fill.abandon()``; an error is logged, so that the fills after it are given up too."""
    try:
        fill.abandon()
    except Exception:
        logger.exception("giving up a deferred copy or claim failed")
