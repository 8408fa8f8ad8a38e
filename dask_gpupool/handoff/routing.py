"""How a value of this worker's pool goes to the worker that asked for it: a pure decision.

:func:`route` looks only at what it is given: this worker's registry row, the
requester's row (if the registry has one), the comm's scheme and a few facts
about the buffer and the pool. It answers a :class:`Route`: hand the buffer
over (the requester's row, no reason), an expected copy (another host, a
client: no row, no reason), or a copy a same-host peer could have been
spared (a reason from :data:`~dask_gpupool.handoff.stats.FALLBACK_REASONS`,
which :meth:`~dask_gpupool.handoff.routes.Routes.plan` counts and warns
about once). ``tests/handoff/test_routing.py`` pins the decisions, one row each.
"""

from __future__ import annotations

from typing import NamedTuple

from dask_gpupool.wire.registry import PoolRecord

__all__ = ["HANDOFF_SCHEMES", "TCP_SCHEMES", "UCX_SCHEMES", "Route", "host_of", "plain_copy_reason", "route"]

#: Comms whose frames go through host memory (Dask's TCP, and TLS over it); UCX carries device frames itself.
TCP_SCHEMES = ("tcp", "tls")
#: Comms over UCX (distributed-ucxx serves both), which carry device frames GPU to GPU.
UCX_SCHEMES = ("ucx", "ucxx")
#: Comms over which a same-host worker gets IPC descriptors: the bytes of a descriptor travel in
#: Dask's frames, so any comm that carries frames between processes would do; these are the ones tested.
HANDOFF_SCHEMES = (*TCP_SCHEMES, *UCX_SCHEMES)


class Route(NamedTuple):
    """The decision: ``row`` is the requester's registry row when it gets the buffer handed over."""

    row: PoolRecord | None
    reason: str | None


def route(
    own: PoolRecord,
    requester: str | None,
    row: PoolRecord | None,
    scheme: str,
    *,
    pool_open: bool,
    owned: bool,
    unreachable: bool = False,
    nbytes: int = 0,
    handoff_threshold: int = 0,
) -> Route:
    """Decide how a buffer of this worker's pool goes to ``requester``.

    Parameters
    ----------
    own : PoolRecord
        This worker's row (its host, pid, pool kind, GPU and the GPUs granted access).
    requester : str or None
        The address of the worker that asked (``None``: not a worker's ``get_data``).
    row : PoolRecord or None
        The requester's row in this worker's registry view, if it has one.
    scheme : str
        The comm's scheme (``"tcp"``, ``"ucxx"``, ...).
    pool_open : bool
        This worker's service and pool are not closing.
    owned : bool
        The buffer lies in this worker's pool.
    unreachable : bool
        A recent transfer to the requester failed (it gets copies for a while).
    nbytes : int
        Bytes of the value.
    handoff_threshold : int
        Over TCP or TLS, a value under this many bytes is copied instead
        (``small``: the comm moves it faster than a handoff's lease claim); 0: never.

    Returns
    -------
    Route
        ``(row, None)``: hand over; ``(None, None)``: an expected copy;
        ``(row or None, reason)``: a same-host copy, for ``reason``.
    """
    if row is None:
        if requester is not None and pool_open and owned and host_of(requester) == host_of(own.worker):
            return Route(None, "unknown-requester")  # a worker here with no pool, or no row yet
        return Route(None, None)
    if row.host != own.host:
        return Route(None, None)
    if row.pid == own.pid:
        reason = "same-process"
    elif scheme not in HANDOFF_SCHEMES:
        reason = "comm"
    elif not pool_open:
        reason = "pool-closed"
    elif not owned:
        reason = "not-in-pool"
    elif unreachable:
        reason = "peer-unreachable"
    elif own.kind == "device" and own.device not in row.devices:
        reason = "no-access"
    elif own.kind == "device" and row.device not in (own.device, *own.peers):
        reason = "other-gpu"
    elif own.kind == "pinned" and not row.devices:
        reason = "no-access"
    elif nbytes < handoff_threshold and scheme in TCP_SCHEMES:
        reason = "small"
    else:
        return Route(row, None)
    return Route(row, reason)


def plain_copy_reason(own: PoolRecord, requester: str | None, row: PoolRecord | None) -> str | None:
    """Why a value outside every pool, sent to ``requester``, is a same-host copy; ``None`` when it is not one.

    ``"not-in-pool"`` for a worker of this host in another process,
    ``"unknown-requester"`` for a worker at this host's address with no row,
    ``None`` for another host, this process, or a request that is not a worker's.
    """
    if row is None:
        if requester is not None and host_of(requester) == host_of(own.worker):
            return "unknown-requester"
        return None
    if row.host != own.host or row.pid == own.pid:
        return None
    return "not-in-pool"


def host_of(address: str) -> str:
    """The host part of a Dask address (``tcp://10.0.0.1:8786`` -> ``10.0.0.1``); ``""`` if it has none."""
    from distributed.comm import get_address_host

    try:
        return str(get_address_host(address))
    except Exception:
        return ""
