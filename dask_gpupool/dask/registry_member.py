"""A worker's side of the registry: its registration handshake, the updates it holds, its row and stats pushes.

The registration handshake, all on the worker's batched stream to the scheduler, in order:

1. ``gpupool-register`` (this worker's row) goes to the scheduler at the end
   of setup (:meth:`RegistryMember.register`). Setup does not wait for the
   answer: a worker joining a running cluster sets its plugins up before it
   reads its stream.
2. ``gpupool-membership`` comes back (:meth:`RegistryMember.on_membership`,
   event loop): the broker, copy server and links take the token at once, and
   ``gpupool-joined`` goes back. Until then the broker refuses everyone.
3. The scheduler publishes the row; peers learn it from ``gpupool-registry``.
   This worker applies its snapshot and the updates it held only when its own
   row comes back that way (:meth:`RegistryMember.on_registry_update`).
   Until then its registry view is empty, so it hands its peers copies only;
   and peers, which learn its row only from that publication, hand it
   nothing zero-copy before it holds the token and the registry.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from dask_gpupool.core import JOINED_OP, MEMBERSHIP_OP, REGISTER_OP, REGISTRY_OP, UNREGISTER_OP, UPDATE_OP
from dask_gpupool.dask.comms import LOST_OP
from dask_gpupool.errors import ProtocolError
from dask_gpupool.ops.dashboard import STATS_OP
from dask_gpupool.wire.registry import Membership, RegistryUpdate

if TYPE_CHECKING:
    from dask_gpupool.handoff.service import PoolService

__all__ = ["RegistryMember"]

logger = logging.getLogger(__name__)


class RegistryMember:
    """One worker's membership in the registry, over its batched stream to the scheduler.

    Parameters
    ----------
    service : PoolService
        The worker's service: its row, its registry view, its broker's token.
    stream : callable
        ``stream()``: the worker's batched stream to the scheduler now (``worker.batched_stream``; it may be
        replaced when the worker reconnects), or ``None``.

    Notes
    -----
    Every method runs on the worker's event loop. A malformed message from the scheduler is logged, not raised: an
    exception in a stream handler would end the worker's stream.
    """

    def __init__(self, service: PoolService, stream: Callable[[], Any]) -> None:
        self.service = service
        self._stream = stream
        self._held: list[RegistryUpdate] | None = []  # held until this worker's own row is published
        self._closed = False

    @property
    def stream_handlers(self) -> dict[str, Callable[..., None]]:
        """The worker's stream handlers of the scheduler's pushes."""
        return {REGISTRY_OP: self.on_registry_update, MEMBERSHIP_OP: self.on_membership}

    def close(self) -> None:
        """Stop taking the scheduler's messages (the plugin is torn down)."""
        self._closed = True
        self._held = None

    def register(self) -> None:
        """Send ``gpupool-register`` with this worker's row (last in setup: the answer arrives on the stream)."""
        self._stream().send({"op": REGISTER_OP, "record": self.service.record.to_msg()})

    def unregister(self) -> None:
        """Take the row out, over this worker's own stream (ahead of any later registration on it), if joined."""
        stream, key = self._stream(), self.service.registry_key
        if stream is not None and not stream.closed() and key is not None:
            with contextlib.suppress(Exception):
                stream.send({"op": UNREGISTER_OP, "pool": self.service.pool.uuid, "key": key})

    def send_row(self) -> None:
        """Send this worker's registry row as it is now (its ``reclaim``) to the scheduler, if the stream is open."""
        service = self.service
        key = service.registry_key
        if not service.closed and key is not None:
            # no key yet: not joined, and the row gpupool-joined sends is refreshed then
            stream = self._stream()
            if stream is not None and not stream.closed():
                stream.send({"op": UPDATE_OP, "record": service.refresh_row().to_msg(), "key": key})

    def report_lost(self, task: Any, sender: str, error: str) -> None:
        """Tell the scheduler that this worker's fetches of key ``task`` from ``sender`` failed again and again (the
        last with ``error``): the tasks here that wait for it err (:mod:`~dask_gpupool.dask.comms`). Sent with
        this worker's registry key; nothing before it joined, or once its stream is closed."""
        service, stream = self.service, self._stream()
        if self._closed or service.registry_key is None or stream is None or stream.closed():
            return
        stream.send({"op": LOST_OP, "task": task, "sender": sender, "error": error, "key": service.registry_key})

    def push_stats(self) -> None:
        """Send this worker's pool and handoff stats to the scheduler (the /gpupool page)."""
        service, stream = self.service, self._stream()
        if self._closed or service.closed or stream is None or stream.closed():
            return
        try:
            stats = {**service.handoff_stats(), **service.pool.stats().to_msg()}
            stream.send({"op": STATS_OP, "stats": stats})
        except Exception:  # a closing stream; the next push or the teardown settles it
            logger.debug("gpupool: stats push failed", exc_info=True)

    def on_membership(self, **msg: Any) -> None:
        """The scheduler's answer to this worker's registration.

        The token goes to the broker, copy server and links at once (peers
        may connect as soon as the row is published); the registry snapshot
        is held until this worker's own row comes back published
        (:meth:`on_registry_update`). Then ``gpupool-joined`` tells the
        scheduler to publish the row.
        """
        service = self.service
        if self._closed or service.closed:
            return
        try:
            membership = Membership.from_msg(msg)
        except ProtocolError:
            logger.error("pool %s: malformed membership from the scheduler", service.pool.uuid, exc_info=True)
            return
        service.join(Membership(RegistryUpdate(0), membership.token, membership.key))
        self._hold([membership.snapshot])
        # This worker's own row, as it is now: a registration another worker sent in this one's name (which
        # brought this Membership too) had a row of its own making, and that row is never published.
        row = service.refresh_row()
        self._stream().send({"op": JOINED_OP, "record": row.to_msg(), "key": membership.key})

    def on_registry_update(self, **msg: Any) -> None:
        """A registry change pushed by the scheduler."""
        if self._closed:
            return
        try:
            update = RegistryUpdate.from_msg(msg)
        except ProtocolError:
            logger.error("pool %s: malformed registry update from the scheduler", self.service.pool.uuid, exc_info=True)
            return
        self._hold([update])

    def _hold(self, updates: list[RegistryUpdate]) -> None:
        """Apply ``updates``, or hold them while this worker's own row is not published yet.

        Held updates are applied together, in arrival order (the view sorts
        out their versions), with the one that publishes this worker's row.
        """
        if self._closed:
            return
        if self._held is not None:
            self._held.extend(updates)
            if not any(r.pool == self.service.pool.uuid for u in updates if not u.snapshot for r in u.added):
                return
            updates, self._held = self._held, None
        for update in updates:
            self.service.apply_registry(update)
