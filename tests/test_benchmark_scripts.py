"""The benchmark scripts the GPU machines run still run: tiny CPU runs of ``handoff.py`` and ``workloads.py``.

A script that fails on a GPU machine costs a GPU run, so the options of each script that
``scripts/gpu-check.sh`` runs are run here on ``host`` pools, small. Nothing here times anything: the
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
    # host pools hand over from 64 KiB (dask_gpupool.tuning.HOST_HANDOFF_THRESHOLD): both sizes are handoffs
    out = _run("handoff.py", ["--sizes", "64KiB,1MiB", "--methods", "gpupool", "--repeats", "2"], tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "steps: export" in out.stdout
    (run,) = _rows(tmp_path, "handoff")["runs"]
    for row in run["rows"]:
        assert row["timings"]["export"]["count"] == 2  # the two timed samples, not the warm-up
        assert row["timings"]["import"]["count"] == 2


def test_pool_mapping_imports_every_buffer_of_the_peers_pool(tmp_path):
    """The host run (the one pool kind without a GPU; device and pinned runs beside it with one): the peer's pool
    mapped once, each size imported and read back."""
    out = _run("pool_mapping.py", ["--repeats", "1"], tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    (run,) = [r for r in _rows(tmp_path, "pool_mapping")["runs"] if r["kind"] == "host"]
    assert run["kind"] == "host" and "error" not in run and run["map_pool_s"] > 0
    sizes = {str(n) for n in (4096, 1 << 20, 64 << 20)}
    assert set(run["first_import_s"]) == set(run["import_s"]) == sizes
    assert run["segments_mapped"] == 0  # host pools have no segments


def test_ucx_pairs_summarizes_each_ab_variant_against_the_last_pair_by_pair():
    """``ucx_pairs.py``'s summary of an ``-ab`` method (printed and saved after each method, so that a run cut off by
    its time limit keeps it): per same/other "host" and size, the mean of each pair's ratio and difference, and the
    pairs at or below the last variant; a pair without the other variant's median is left out."""
    before = set(sys.modules)
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from ucx_pairs import ab_summary
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
        for name in {"ucx_pairs", "handoff"} - before:  # the scripts, imported by their file names
            sys.modules.pop(name, None)

    def row(variant, src, dst, same, seconds, nbytes=1 << 20):
        return {"method": f"m-ab:{variant}", "src": src, "dst": dst, "nbytes": nbytes, "same_host": same,
                "transfer_s": seconds}  # fmt: skip

    rows = [
        row("on", "w0", "w2", False, 0.0030), row("off", "w0", "w2", False, 0.0020),
        row("on", "w2", "w0", False, 0.0010), row("off", "w2", "w0", False, 0.0020),
        row("on", "w0", "w1", True, 0.0015), row("off", "w0", "w1", True, 0.0030),
        row("on", "w1", "w0", True, 0.0015), row("off", "w1", "w0", True, None),  # no median: left out
    ]  # fmt: skip
    summary = {(s["same_host"], s["variant"], s["against"]): s for s in ab_summary(rows, "m-ab", ["on", "off"])}
    other, same = summary[(False, "on", "off")], summary[(True, "on", "off")]
    assert other["pairs"] == 2 and other["at_or_below"] == 1
    assert abs(other["ratio"] - 1.0) < 1e-12 and abs(other["diff_s"]) < 1e-12  # (1.5 + 0.5) / 2, (+1 - 1) / 2 ms
    assert same["pairs"] == 1 and same["at_or_below"] == 1 and abs(same["ratio"] - 0.5) < 1e-12
    assert len(summary) == 2
    # the same method run again is another cluster: summed up on its own, never paired with the first's rows
    again = [{**r, "run": 1} for r in rows[:2]] + [{**row("on", "w2", "w0", False, 0.0040), "run": 1}]
    (second,) = [s for s in ab_summary(rows + again, "m-ab", ["on", "off"], run=1) if not s["same_host"]]
    assert second["pairs"] == 1 and second["at_or_below"] == 0 and abs(second["ratio"] - 1.5) < 1e-12


def test_etl_pipeline_compares_the_example_with_and_without_the_plugin(tmp_path):
    """``etl_pipeline.py`` runs ``examples/etl_pipeline.py`` on a cluster without the plugin and one with it: both
    compute the same values, the plugin's run hands its chunks over zero-copy and plain Dask's copies them."""
    args = ["--size", "8MiB", "--chunks", "4", "--workers", "2", "--rounds", "1", "--repeats", "1"]
    out = _run("etl_pipeline.py", args, tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "values agree" in out.stdout
    summary = _rows(tmp_path, "etl_pipeline")["summary"]
    assert summary["gpupool"]["zero_copy_bytes"]["median"] > 0
    assert summary["plain"]["zero_copy_bytes"]["median"] == 0 and summary["plain"]["copied_bytes"]["median"] > 0
    assert set(summary["plain"]) >= {"generate", "transform", "reduce by key", "combine", "total_s"}
