"""What :func:`dask_gpupool.stats` and :func:`dask_gpupool.pool_stats` return: per-worker dicts that print as tables.

Each is the ``{worker address: dict}`` the function documents, a :class:`dict` itself (indexed, iterated, compared,
pickled and JSON-encoded as one), that prints (``str``, ``repr``, IPython) as a header and one line per worker with
what a reader looks at first, sizes in human units; ``.raw`` is the plain dict, every counter in it. A worker
without a pool, or that did not answer, is one line saying so.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

__all__ = ["HandoffTable", "PoolTable", "WorkerTable", "problem"]

Row = dict[str, Any]


def problem(error: str) -> str:
    """A worker's ``{"error": why}`` as a cell: ``no answer within N s`` (stopped, busy), else ``no pool: why``."""
    if error.startswith("TimeoutError: no answer"):
        return error.removeprefix("TimeoutError: ")
    return f"no pool: {error}"


def _bytes(n: Any) -> str:
    from dask.utils import format_bytes

    return format_bytes(n) if isinstance(n, int) else "-"


def _used_of_max(row: Row) -> str:
    return f"{_bytes(row.get('used'))} / {_bytes(row.get('max_size'))}"


def _held_by_peers(row: Row) -> str:
    """Live leases this worker granted, and the bytes they keep alive."""
    leases = row.get("leases", 0)
    return f"{leases} ({_bytes(row.get('lease_bytes', 0))})" if leases else "0"


def _fallbacks(row: Row) -> str:
    """The total, then by reason: ``3: not-in-pool 2, small 1``."""
    by_reason = row.get("fallbacks") or {}
    if not isinstance(by_reason, dict) or not by_reason:
        return "0"
    reasons = ", ".join(f"{k} {v}" for k, v in sorted(by_reason.items()))
    return f"{sum(by_reason.values())}: {reasons}"


def _count(key: str) -> Callable[[Row], str]:
    return lambda row: str(row.get(key, "-"))


def _size(key: str) -> Callable[[Row], str]:
    return lambda row: _bytes(row.get(key))


class WorkerTable(dict[str, Row]):
    """``{worker address: dict}`` that prints as a table: the worker, then :attr:`columns`, one line per worker.

    Attributes
    ----------
    columns : tuple of (str, callable, str)
        Each column's title, the function of a worker's dict giving its cell, and ``"<"`` (left) or ``">"``
        (right-aligned).
    """

    columns: ClassVar[tuple[tuple[str, Callable[[Row], str], str], ...]] = ()

    @property
    def raw(self) -> dict[str, Row]:
        """The plain ``{worker address: dict}``, every counter of every worker."""
        return dict(self)

    def __str__(self) -> str:
        if not self:
            return "no workers"
        header = ["worker", *(title for title, _, _ in self.columns)]
        aligns = ["<", *(align for _, _, align in self.columns)]
        rows = {w: [w, *(cell(r) for _, cell, _ in self.columns)] for w, r in self.items() if "error" not in r}
        widths = [max(len(cells[i]) for cells in [header, *rows.values()]) for i in range(len(header))]
        widths[0] = max(widths[0], *map(len, self))

        def line(cells: list[str]) -> str:
            return "  ".join(f"{c:{a}{w}}" for c, a, w in zip(cells, aligns, widths, strict=True)).rstrip()

        out = [line(header)]
        for w in sorted(self):
            if w in rows:
                out.append(line(rows[w]))
            else:
                out.append(f"{w:{widths[0]}}  {problem(str(self[w]['error']))}")
        return "\n".join(out)

    __repr__ = __str__

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        """IPython and Jupyter show the table too (their printer of dicts would show every counter)."""
        p.text(str(self))


class HandoffTable(WorkerTable):
    """What :func:`dask_gpupool.stats` returns: the pool's kind and use, bytes received zero-copy, buffers handed
    over, bytes copied in and out, what peers' leases hold here (lent) and what this worker
    holds of peers' pools (borrowed), and fallbacks, per worker."""

    columns = (
        ("pool", _count("kind"), "<"),
        ("used / max", _used_of_max, ">"),
        ("zero-copy in", _size("zero_copy_bytes"), ">"),
        ("handed over", _count("exports"), ">"),
        ("copied in", _size("copied_bytes"), ">"),
        ("copied out", _size("copied_out_bytes"), ">"),
        ("lent", _held_by_peers, ">"),
        ("borrowed", _size("borrowed_bytes"), ">"),
        ("fallbacks", _fallbacks, "<"),
    )


class PoolTable(WorkerTable):
    """What :func:`dask_gpupool.pool_stats` returns: each pool's kind, used and reserved bytes (now and at most),
    its upper bound and the peers' pools mapped there, per worker."""

    columns = (
        ("pool", _count("kind"), "<"),
        ("used", _size("used"), ">"),
        ("used high", _size("used_high"), ">"),
        ("reserved", _size("reserved"), ">"),
        ("reserved high", _size("reserved_high"), ">"),
        ("max", _size("max_size"), ">"),
        ("peer pools mapped", _count("mapped_pools"), ">"),
    )
