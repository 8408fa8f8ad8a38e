"""The scheduler's ``/gpupool`` page (and ``/gpupool.json``).

Workers push their pool and handoff statistics to the scheduler every
:data:`STATS_INTERVAL` seconds over their batched stream
(:data:`STATS_OP`); the scheduler plugin keeps the latest per worker. The
page lists the registry's pools (owner, host, kind, device, used and
reserved bytes, and ``peer GPUs``: how many other GPUs were granted access
to the pool, whose workers map it zero-copy) and every worker's handoffs
(zero-copy vs copied bytes, fallbacks by reason, live leases), and reloads
itself. It is served by the scheduler's own HTTP server, next to Dask's
dashboard, on the routes :func:`routes` gives (added by
:func:`dask_gpupool.dask.distributed_seam.scheduler.serve_page`).

Trust boundary: the pushed statistics are each worker's own claim. The page
escapes every value and key it shows (:func:`html.escape`, whatever the
value's type), and ``/gpupool.json`` carries no raw ``<``, ``>`` or ``&``.
``/gpupool.json`` is strict JSON: a NaN or infinite number that a worker
pushes is kept as ``None`` (:func:`finite`, when the push arrives), and the
output is checked again (``null``), never ``NaN`` or ``Infinity``, which
strict parsers refuse.

Threads: both handlers run on the scheduler's event loop.
"""

from __future__ import annotations

import html
import json
import math
from collections.abc import Callable
from typing import Any

from tornado import web

__all__ = ["STATS_INTERVAL", "STATS_OP", "Source", "finite", "routes"]

#: Seconds between a worker's statistics pushes (and the page's reloads).
STATS_INTERVAL = 2.0
#: Batched-stream op of a worker's statistics push.
STATS_OP = "gpupool-stats"

Source = Callable[[], dict[str, Any]]


def finite(value: Any) -> Any:
    """``value`` with every NaN or infinite float in it (in dicts, lists and tuples, at any depth) made ``None``,
    and such a float used as a dict key made text (``"nan"``, ``"inf"``, ``"-inf"``).

    Strict JSON has no NaN or Infinity (``json.dumps`` writes them by default, and ``JSON.parse``, Go and jq refuse
    the result). Raises :class:`RecursionError` for a value nested deeper than Python's recursion limit.
    """
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        # a NaN or infinite key as text (json.dumps writes float keys as text too; allow_nan=False refuses these)
        return {str(k) if isinstance(k, float) and not math.isfinite(k) else k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def _bytes(n: Any) -> str:
    from dask.utils import format_bytes

    return format_bytes(int(n)) if isinstance(n, int) else "-"


def _text(value: Any) -> str:
    """``value`` as HTML text: every pushed value is the worker's claim, escaped whatever its type."""
    return html.escape(str(value))


def _fallbacks(value: Any) -> str:
    if not isinstance(value, dict):
        return _text(value)
    return _text(", ".join(f"{k}: {v}" for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))) or "-")


def _mean_ms(timings: Any, step: str) -> str:
    """The mean of a timed step in ms (``stats()["timings"]``), or ``-`` when it never ran."""
    t = timings.get(step) if isinstance(timings, dict) else None
    try:
        return f"{float(t['total_s']) / int(t['count']) * 1e3:.2f}" if t and int(t["count"]) else "-"
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return "-"


class _Page(web.RequestHandler):
    def initialize(self, holder: dict[str, Source]) -> None:
        self._holder = holder

    def get(self) -> None:
        snap = self._holder["source"]()
        rows = "".join(
            f"<tr><td>{_text(p['worker'])}</td><td>{_text(p['hostname'])}</td><td>{_text(p['kind'])}</td>"
            f"<td>{_text(p['device'] or '-')}</td><td>{_bytes(p.get('used'))}</td>"
            f"<td>{_bytes(p.get('reserved'))}</td><td>{_bytes(p['max_size'])}</td><td>{len(p['peers'])}</td>"
            f"<td><code>{_text(p['pool'])}</code></td></tr>"
            for p in snap["pools"]
        )
        stats = "".join(
            f"<tr><td>{_text(w)}</td><td colspan='12' style='text-align:left;color:#b00'>"
            f"no pool: {_text(s['error'])}</td></tr>"
            if "error" in s
            else f"<tr><td>{_text(w)}</td><td>{_text(s.get('exports', 0))}</td><td>{_text(s.get('imports', 0))}</td>"
            f"<td>{_text(s.get('forwards', 0))} / {_text(s.get('returns', 0))}</td>"
            f"<td>{_mean_ms(s.get('timings', {}), 'import')} ({_mean_ms(s.get('timings', {}), 'claim')})</td>"
            f"<td>{_text(s.get('leases', 0))}</td><td>{_bytes(s.get('lease_bytes', 0))}</td>"
            f"<td>{_bytes(s.get('borrowed_bytes', 0))}</td>"
            f"<td>{_bytes(s.get('zero_copy_bytes', 0))}</td>"
            f"<td>{_bytes(s.get('copied_bytes', 0))}</td>"
            f"<td>{_bytes(s.get('copied_out_bytes', 0))}</td>"
            f"<td>{_text(s.get('segments', 0))} ({_text(s.get('segments_retiring', 0))})</td>"
            f"<td>{_fallbacks(s.get('fallbacks', {}))}</td></tr>"
            for w, s in sorted(snap["workers"].items())
        )
        self.set_header("Content-Type", "text/html; charset=utf-8")
        self.write(
            "<!doctype html><html><head><meta charset='utf-8'>"
            f"<meta http-equiv='refresh' content='{int(STATS_INTERVAL)}'><title>gpupool</title>"
            "<style>body{font-family:sans-serif;margin:1em}table{border-collapse:collapse;margin-bottom:1.5em}"
            "td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}th{background:#eee}"
            "td:first-child{text-align:left}</style></head><body>"
            f"<h2>gpupool: {len(snap['pools'])} pool(s)</h2>"
            "<table><tr><th>worker</th><th>host</th><th>kind</th><th>device</th><th>used</th><th>reserved</th>"
            f"<th>max</th><th>peer GPUs</th><th>pool</th></tr>{rows}</table>"
            "<h2>Handoffs per worker</h2>"
            "<table><tr><th>worker</th><th>exports</th><th>imports</th><th>passed on / back</th>"
            "<th>mean import, ms (claim)</th><th>live leases</th><th>lent</th><th>borrowed</th>"
            "<th>zero-copy in</th><th>copied in</th><th>copied out</th><th>segments (retiring)</th>"
            "<th>fallbacks</th></tr>"
            f"{stats}</table><p>Reloads every {STATS_INTERVAL:g} s. JSON: <a href='gpupool.json'>gpupool.json</a>"
            "</p></body></html>"
        )


class _Json(web.RequestHandler):
    def initialize(self, holder: dict[str, Source]) -> None:
        self._holder = holder

    def get(self) -> None:
        self.set_header("Content-Type", "application/json")
        self.set_header("X-Content-Type-Options", "nosniff")
        # No raw <, > or & (JSON's \u escapes instead): the pushed strings cannot open or close
        # markup where this is embedded. Values JSON cannot carry (bytes) go as their repr; NaN and infinities
        # as null (strict JSON has neither: finite(), and allow_nan=False so that none slips through).
        text = json.dumps(finite(self._holder["source"]()), skipkeys=True, default=repr, allow_nan=False)
        self.write(text.replace("&", "\\u0026").replace("<", "\\u003c").replace(">", "\\u003e"))


def routes(holder: dict[str, Source]) -> list[tuple[str, type, dict[str, Any]]]:
    """The page's tornado routes, ``/gpupool`` and ``/gpupool.json``, showing ``holder["source"]()`` (the holder's
    owner may swap the source)."""
    return [(r"/gpupool", _Page, {"holder": holder}), (r"/gpupool\.json", _Json, {"holder": holder})]
