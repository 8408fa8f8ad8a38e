"""The scheduler's ``/gpupool`` page and ``/gpupool.json``: what they list, in a browser, and whatever a worker
pushes."""

from __future__ import annotations

import os
import re
import subprocess

import pytest
from conftest import (
    PLUGIN,
    dashboard_base,
    nanny_cluster,
    wait_for,
    worker_addresses,
)

from dask_gpupool import testing as T

MiB = 1 << 20


def test_dashboard_page_lists_pools_and_handoffs():
    import importlib.util
    import json
    import urllib.request

    from conftest import warm_up

    with nanny_cluster([{}, {}], PLUGIN) as c:
        a, b = worker_addresses(c)
        warm_up(c, a, b)
        base = dashboard_base(c)

        def page(path: str) -> str:
            with urllib.request.urlopen(base + path, timeout=10) as r:
                return r.read().decode()

        def imports_seen() -> bool:
            snap = json.loads(page("/gpupool.json"))
            return len(snap["pools"]) == 2 and all(snap["workers"].get(w, {}).get("imports") == 1 for w in (a, b))

        wait_for(imports_seen, what="both workers' pushed stats on the page")
        html = page("/gpupool")
        assert "2 pool(s)" in html and a in html and b in html and "zero-copy in" in html
        assert "http-equiv='refresh'" in html
        # each worker imported once: its mean import time is a number; no claim round trip was timed
        # (claimed by the reply)
        assert "mean import, ms (claim)" in html
        assert re.search(r"<td>\d+\.\d\d \(-\)</td>", html), html
        # linked from Dask's own dashboard: the "More..." menu of every page (Bokeh, a test dependency, serves it)
        if importlib.util.find_spec("bokeh") is not None:
            assert '<a href="gpupool">GPU Pool</a>' in page("/status")


def test_dashboard_page_in_a_headless_browser(tmp_path):
    """The /gpupool page as Debian's chromium renders it (skips where chromium is not installed).

    With GPUPOOL_SCREENSHOT=path the screenshot is also written there (docs/_static/gpupool-page.png).
    """
    import shutil

    from conftest import wait_for, warm_up
    from distributed import wait

    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        pytest.skip("no chromium (Debian package 'chromium')")

    def render(url: str, *extra: str) -> str:
        out = subprocess.run(
            [
                browser,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                f"--user-data-dir={tmp_path / 'profile'}",
                "--window-size=1280,720",
                *extra,
                url,
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr[-2000:]
        return out.stdout

    with nanny_cluster([{}, {}, {}], PLUGIN) as c:
        a, b, third = worker_addresses(c)
        warm_up(c, a, b)
        x = c.submit(T.make_buffer, 3 * MiB, b"x", workers=[a], pure=False)
        y = c.submit(T.keep, x, workers=[third], pure=False)  # a live lease on A, held by the third worker
        wait(y)  # not y.result(): the client's copy would show as copied out
        url = dashboard_base(c) + "/gpupool"
        # the workers push their stats every 2 s: wait until the browser shows A's 3 MiB lease
        wait_for(lambda: "3.00 MiB" in render(url, "--dump-dom"), what="the page to show the pushed stats")
        dom = render(url, "--dump-dom")
        assert "3 pool(s)" in dom and "live leases" in dom and all(w in dom for w in (a, b, third))
        shot = tmp_path / "gpupool.png"
        render(url, f"--screenshot={shot}")
        assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000
        if os.environ.get("GPUPOOL_SCREENSHOT"):
            shutil.copy(shot, os.environ["GPUPOOL_SCREENSHOT"])
        del x, y


def test_dashboard_page_escapes_every_pushed_value():
    """A worker's stats push is the worker's claim: every value and key on /gpupool is escaped, and the page
    still renders when the values have the wrong types; /gpupool.json carries them back unchanged but with no raw
    ``<``."""
    import json
    import urllib.error
    import urllib.request

    from dask_gpupool.ops.dashboard import STATS_OP

    evil = "<script>alert(1)</script>"
    pushes = [
        {
            "exports": evil,
            "imports": f"{evil}imports",
            "leases": f"{evil}leases",
            "lease_bytes": evil,
            "zero_copy_bytes": evil,
            "segments": f"{evil}segments",
            "segments_retiring": f"{evil}retiring",
            "fallbacks": {f"{evil}key": f"{evil}value"},
            "used": evil,
            "reserved": evil,
        },
        {"exports": [evil], "imports": {evil: evil}, "fallbacks": f"{evil}fallbacks", "used": [evil]},
    ]

    def push(stats, dask_worker):
        dask_worker.plugins["gpupool"]._push.stop()  # no honest push overwrites this one
        dask_worker.batched_stream.send({"op": STATS_OP, "stats": stats})

    with nanny_cluster([{}, {}], PLUGIN) as c:
        by_worker = dict(zip(worker_addresses(c), pushes, strict=True))
        before = c.run(T.resources)
        for w, stats in by_worker.items():
            c.run(push, stats, workers=[w])
        base = dashboard_base(c)

        def fetch(path: str) -> tuple[str, str]:
            with urllib.request.urlopen(base + path, timeout=10) as r:
                return r.read().decode(), r.headers.get("Content-Type", "")

        def pushed() -> bool:
            snap = json.loads(fetch("/gpupool.json")[0])
            return all(snap["workers"].get(w) == stats for w, stats in by_worker.items())

        wait_for(pushed, what="the hostile pushes to reach the scheduler")
        try:
            page, kind = fetch("/gpupool")
        except urllib.error.HTTPError as e:
            raise AssertionError(f"/gpupool failed on hostile stats: {e}") from e
        assert kind.startswith("text/html")
        assert "<script" not in page.lower()  # the page has no script of its own, and none came in
        for text in ("imports", "leases", "segments", "retiring", "key", "value", "fallbacks"):
            assert f"&lt;script&gt;alert(1)&lt;/script&gt;{text}" in page, text
        raw, kind = fetch("/gpupool.json")
        assert kind.startswith("application/json") and "<" not in raw
        assert all(json.loads(raw)["workers"][w] == stats for w, stats in by_worker.items())
        assert c.run(T.resources) == before  # the workers hold nothing more for it


def test_gpupool_json_is_strict_json_whatever_a_worker_pushes():
    """A worker's push with NaN or infinite numbers made ``/gpupool.json`` carry ``NaN`` and ``Infinity``, which
    strict JSON parsers (JavaScript's ``JSON.parse``, Go's, jq's) refuse: the scheduler keeps them as null, and the
    page still renders."""
    import json
    import math
    import urllib.request

    from dask_gpupool.ops.dashboard import STATS_OP

    nan, inf = math.nan, math.inf
    stats = {
        "leases": 7,
        "exports": nan,
        "lease_bytes": -inf,
        "fallbacks": {"small": inf},
        "timings": {"import": {"count": 1, "total_s": nan}},
        "samples": [1.5, nan, [inf]],
    }
    finite = {
        "leases": 7,
        "exports": None,
        "lease_bytes": None,
        "fallbacks": {"small": None},
        "timings": {"import": {"count": 1, "total_s": None}},
        "samples": [1.5, None, [None]],
    }

    def push(dask_worker):
        dask_worker.plugins["gpupool"]._push.stop()  # no honest push overwrites this one
        dask_worker.batched_stream.send({"op": STATS_OP, "stats": stats})

    def strict(text: str):
        def refuse(constant: str):
            raise ValueError(f"not JSON: {constant}")

        return json.loads(text, parse_constant=refuse)

    with nanny_cluster([{}, {}], PLUGIN) as c:
        a, _ = worker_addresses(c)
        c.run(push, workers=[a])
        base = dashboard_base(c)

        def fetch(path: str) -> str:
            with urllib.request.urlopen(base + path, timeout=10) as r:
                return r.read().decode()

        wait_for(lambda: json.loads(fetch("/gpupool.json"))["workers"].get(a, {}).get("leases") == 7, what="the push")
        assert strict(fetch("/gpupool.json"))["workers"][a] == finite
        assert "<td>7</td>" in fetch("/gpupool")


def test_gpupool_json_answers_when_a_worker_pushes_a_nan_or_infinite_key():
    """A worker's push whose dicts have NaN or infinite numbers as keys (msgpack carries them): ``finite`` made the
    values null but left the keys, and ``json.dumps(..., allow_nan=False)`` raised on them, so ``/gpupool.json``
    answered 500 for the whole cluster for as long as that push was the worker's last. Such keys are kept as text;
    the output is strict JSON, and the page renders."""
    import json
    import math
    import urllib.request

    from dask_gpupool.ops.dashboard import STATS_OP

    stats = {"leases": 9, "fallbacks": {math.nan: 1, math.inf: 2, -math.inf: 3, 1.5: 4}}

    def push(dask_worker):
        dask_worker.plugins["gpupool"]._push.stop()  # no honest push overwrites this one
        dask_worker.batched_stream.send({"op": STATS_OP, "stats": stats})

    def refuse(constant: str):
        raise ValueError(f"not JSON: {constant}")

    with nanny_cluster([{}, {}], PLUGIN) as c:
        a, _ = worker_addresses(c)
        c.run(push, workers=[a])
        base = dashboard_base(c)

        def fetch(path: str) -> str:
            try:
                with urllib.request.urlopen(base + path, timeout=10) as r:
                    return r.read().decode()
            except urllib.error.HTTPError as e:
                return f"HTTP {e.code}"

        wait_for(lambda: "<td>9</td>" in fetch("/gpupool"), what="the push")
        text = fetch("/gpupool.json")
        assert not text.startswith("HTTP"), text
        fallbacks = json.loads(text, parse_constant=refuse)["workers"][a]["fallbacks"]
        assert sorted(fallbacks.values()) == [1, 2, 3, 4], fallbacks
