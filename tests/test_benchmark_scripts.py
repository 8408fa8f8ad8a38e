"""The benchmark scripts the GPU sessions run still run: tiny CPU runs of ``handoff.py`` and ``workloads.py``.

Device time is scarce and a script that fails on the GPU machine wastes a call, so each script's options that the
plan in ``docs/gpu-checks.md`` names are run here on ``host`` pools, small. Nothing here times anything: the
checks are that a script exits 0, writes its JSON rows, and (``workloads.py``) that every method computed the same
values and, with the input in bands, moved the same bytes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: ``workloads.py`` methods: plain Dask, the plugin, and the plugin with its parts taken away
METHODS = ("tcp", "gpupool", "gpupool-nohooks", "gpupool-bare", "gpupool-gone", "gpupool-ab")


def _run(script: str, args: list[str], results: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DASK_GPUPOOL") and k != "OUT"}
    env["BENCH_RESULTS"] = str(results)
    return subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *args],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        cwd=ROOT,
    )


def _rows(results: Path, prefix: str) -> list[dict]:
    (path,) = results.glob(f"{prefix}-*.json")
    return json.loads(path.read_text())


def test_workloads_runs_every_kind_of_method_and_the_methods_agree(tmp_path):
    args = "--n 512 --chunk 128 --rounds 1 --repeats 1 --workloads rechunk,map_overlap,rmm_objects --methods"
    out = _run("workloads.py", [*args.split(), ",".join(METHODS)], tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "values agree across methods" in out.stdout
    assert "both paths in one cluster (-ab)" in out.stdout
    rows = _rows(tmp_path, "workloads")["rows"]
    assert {(r["method"], r["workload"]) for r in rows} == {
        (m, w) for m in METHODS for w in ("rechunk", "map_overlap", "rmm_objects")
    }
    for r in rows:
        assert len(r["rounds_s"]) == 1 and r["median_s"] > 0
        assert r["dask_s_rounds"][0].get("gather-dep network", 0) > 0  # Dask's own metrics were read
    ab = [r for r in rows if r["method"] == "gpupool-ab"]
    assert all(len(a["on"]) == len(a["off"]) == 1 for r in ab for a in r["ab_rounds"])  # one pair a round
    # the input in bands of columns: the task rechunk gathers blocks of both workers
    rechunk = [r for r in rows if r["workload"] == "rechunk"]
    assert all(r["copied_bytes"] + r["zero_copy_bytes"] > 0 for r in rechunk)


def test_handoff_records_the_steps_of_the_timed_samples(tmp_path):
    out = _run("handoff.py", ["--sizes", "1KiB,1MiB", "--methods", "gpupool-handoff", "--repeats", "2"], tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "steps: export" in out.stdout
    (run,) = _rows(tmp_path, "handoff")["runs"]
    for row in run["rows"]:
        assert row["timings"]["export"]["count"] == 2  # the two timed samples, not the warm-up
        assert row["timings"]["import"]["count"] == 2
