"""``benchmarks/memory_once.py`` still runs: a small CPU run of every workload and method (nothing timed).

The checks are that it exits 0, writes one JSON row per workload and method, that every value read back right where
the plugin counts memory once, and that no worker spilled a borrowed value there.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_memory_once_runs_every_workload_and_method(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("DASK_GPUPOOL") and k != "OUT"}
    env["BENCH_RESULTS"] = str(tmp_path)
    args = (
        "--value 32MiB --worker-limit 1GiB --part 16MiB --count 4 --consumer-limit 400MiB --producer-limit 1GiB "
        "--pipeline-n 2048 --pipeline-chunk 512 --pipeline-limit 1GiB"
    )
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "memory_once.py"), *args.split(), "--timeout", "60"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    (path,) = tmp_path.glob("memory_once-*.json")
    rows = json.loads(path.read_text())["rows"]
    assert {(r["workload"], r["method"]) for r in rows} == {
        (w, m) for w in ("broadcast", "fanout", "pipeline") for m in ("tcp", "gpupool", "gpupool-plain")
    }
    for r in rows:
        assert r["peak_host_bytes"] > 0 and len(r["spilled_bytes"]) == r["workers"]
        if r["method"] == "gpupool":
            assert r["values_right"] and r["restarts"] == 0, r
            assert r["borrowed_spilled_bytes"] == [0] * r["workers"], r  # no borrowed value spilled
            if r["workload"] != "pipeline":
                assert r["spilled_bytes"][1:] == [0] * (r["workers"] - 1), r  # the borrowers spilled nothing
