"""Draw the plots of docs/performance.md from the benchmark results it cites.

    python scripts/plot_results.py            # writes docs/_static/*.png (needs matplotlib: pip install '.[docs]')
    python scripts/plot_results.py --check    # says which results each plot reads, draws nothing

Each plot names the results file it is drawn from, so a figure on the page can be traced to the run behind it.
Without matplotlib the script says so and exits 1; the committed pictures stay as they are.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
STATIC = ROOT / "docs" / "_static"

#: How the benchmarks name their methods, as the page names them.
LABELS = {
    "tcp": "Dask TCP",
    "ucxx": "Dask UCXX",
    "gpupool": "dask-gpupool over TCP",
    "ucxx+gpupool": "dask-gpupool over UCXX",
    "gpupool-plain": "dask-gpupool, Dask's accounting",
}


def load(name: str) -> dict[str, Any]:
    with open(RESULTS / name) as f:
        return json.load(f)


def size_label(nbytes: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift:
            return f"{nbytes >> shift} {unit}"
    return f"{nbytes} B"


def handoff_by_size(plt: Any, source: str, title: str, out: Path) -> None:
    """Consumer transfer time against value size, one line per method (``benchmarks/handoff.py``)."""
    result = load(source)
    fig, ax = plt.subplots(figsize=(7, 4.2))
    sizes: set[int] = set()
    order = list(LABELS)
    for run in sorted(result["runs"], key=lambda run: order.index(run["method"]) if run["method"] in order else 99):
        rows = sorted(run["rows"], key=lambda row: row["nbytes"])
        xs = [row["nbytes"] for row in rows]
        sizes.update(xs)
        ys = [row["transfer_s"] * 1e3 for row in rows]
        ax.plot(xs, ys, marker="o", label=LABELS.get(run["method"], run["method"]))
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ticks = sorted(sizes)
    ax.set_xticks(ticks, [size_label(n) for n in ticks], rotation=45, fontsize=8)
    ax.set_xlabel("value size")
    ax.set_ylabel("consumer transfer time (ms, median)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.text(0.01, 0.01, f"benchmarks/results/{source}", fontsize=6, color="gray")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(out, dpi=120)
    plt.close(fig)


def workloads_bars(plt: Any, source: str, title: str, out: Path) -> None:
    """Median wall time per ``dask.array`` workload and method (``benchmarks/workloads.py``)."""
    result = load(source)
    rows = result["rows"]
    workloads = list(dict.fromkeys(row["workload"] for row in rows))
    methods = list(dict.fromkeys(row["method"] for row in rows))
    median = {(row["workload"], row["method"]): row["median_s"] * 1e3 for row in rows}
    fig, ax = plt.subplots(figsize=(8, 4.2))
    width = 0.8 / len(methods)
    for i, method in enumerate(methods):
        xs = [w + (i - (len(methods) - 1) / 2) * width for w in range(len(workloads))]
        ys = [median.get((workload, method), 0.0) for workload in workloads]
        ax.bar(xs, ys, width=width, label=LABELS.get(method, method))
    ax.set_xticks(range(len(workloads)), workloads, rotation=20, fontsize=8)
    ax.set_ylabel("wall time (ms, median of the clusters' medians)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fig.text(0.01, 0.01, f"benchmarks/results/{source}", fontsize=6, color="gray")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(out, dpi=120)
    plt.close(fig)


def memory_once_bars(plt: Any, source: str, title: str, out: Path) -> None:
    """Host memory added and bytes spilled to disk per workload and method (``benchmarks/memory_once.py``); a run
    that did not finish with right values is hatched."""
    result = load(source)
    rows = result["rows"]

    def case(row: dict[str, Any]) -> str:
        return f"{row['workload']}, {row['workers']} workers"

    cases = list(dict.fromkeys(case(row) for row in rows))
    methods = list(dict.fromkeys(row["method"] for row in rows))
    by = {(case(row), row["method"]): row for row in rows}
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2))
    width = 0.8 / len(methods)
    panels = (
        (axes[0], lambda row: row["added_host_bytes"] / row["value_bytes"], "host memory added (x the values' size)"),
        (axes[1], lambda row: sum(row["spilled_bytes"]) / (1 << 30), "spilled to disk, all workers (GiB)"),
    )
    for ax, value, label in panels:
        for i, method in enumerate(methods):
            for c, name in enumerate(cases):
                row = by.get((name, method))
                if row is None:
                    continue
                x = c + (i - (len(methods) - 1) / 2) * width
                bar = ax.bar(
                    x, value(row), width=width, color=f"C{i}", label=LABELS.get(method, method) if c == 0 else None
                )
                if not row["values_right"]:
                    bar[0].set_hatch("//")
                    bar[0].set_edgecolor("black")
        ax.set_xticks(range(len(cases)), cases, rotation=20, fontsize=8)
        ax.set_ylabel(label, fontsize=9)
        ax.grid(True, axis="y", alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"{title} (hatched: did not finish)", fontsize=10)
    fig.text(0.01, 0.01, f"benchmarks/results/{source}", fontsize=6, color="gray")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(out, dpi=120)
    plt.close(fig)


#: (picture, drawing, results file, title): every plot docs/performance.md shows.
PLOTS: list[tuple[str, Callable[..., None], str, str]] = [
    (
        "handoff-same-gpu-h200.png",
        handoff_by_size,
        "handoff-20261124-090601-h200x1-1kib-32gib-same-gpu.json",
        "Two workers on one H200 (2026-11-24)",
    ),
    (
        "handoff-other-gpu-h200x2.png",
        handoff_by_size,
        "handoff-20261124-222544-h200x2-other-1k-32g.json",
        "One worker on each of two H200s (2026-11-24)",
    ),
    (
        "workloads-one-gpu-h100.png",
        workloads_bars,
        "workloads-20261125-121547-h100x1-four-methods.json",
        "dask.array workloads, two workers on one H100 (2026-11-25)",
    ),
    (
        "memory-once-cpu.png",
        memory_once_bars,
        "memory_once-20261205-152832-cpu-three-workloads-28597e1.json",
        "Host memory and spilling, host pools on a 2-vCPU container (2026-12-05)",
    ),
]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="list the plots and their results; draw nothing")
    args = p.parse_args(argv)
    missing = [source for _, _, source, _ in PLOTS if not (RESULTS / source).is_file()]
    if missing:
        print(f"plot_results: results not found: {', '.join(missing)}", file=sys.stderr)
        return 1
    if args.check:
        for picture, _, source, _ in PLOTS:
            print(f"docs/_static/{picture} <- benchmarks/results/{source}")
        return 0
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot_results: matplotlib is not installed (pip install '.[docs]'); nothing drawn", file=sys.stderr)
        return 1
    for picture, draw, source, title in PLOTS:
        draw(plt, source, title, STATIC / picture)
        print(f"docs/_static/{picture}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
