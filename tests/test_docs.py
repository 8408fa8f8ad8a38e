"""The README's and the quickstart's code runs as written, and prints what the pages say it prints."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def readme_quickstart() -> tuple[str, str]:
    """The README's quickstart and the output it shows for a host without a GPU."""
    text = (ROOT / "README.md").read_text()
    code = re.search(r"## Quickstart\n\n```python\n(.*?)```", text, re.S).group(1)
    output = re.search(r"On a host without a GPU.*?```text\n(.*?)```", text, re.S).group(1)
    return code, output


def docs_quickstart() -> tuple[str, str]:
    """docs/quickstart.md's first example and the output it shows for a host without a GPU."""
    text = (ROOT / "docs" / "quickstart.md").read_text()
    code = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    output = re.search(r"On a host without a GPU.*?```text\n(.*?)```", text, re.S).group(1)
    return textwrap.dedent(code), output


def ports_left_out(text: str) -> str:
    """``text`` with the port of every loopback address as ``PORT``: the workers' ports are new at each run."""
    return re.sub(r"(tcp://127\.0\.0\.1:)\d+", r"\1PORT", text)


@pytest.mark.parametrize("snippet", [readme_quickstart, docs_quickstart], ids=["readme", "docs-quickstart"])
def test_the_quickstart_runs_and_prints_what_the_page_shows(snippet, tmp_path):
    """Run as a user would, without a GPU in sight (``host`` pools): the output is the page's, line for line, but
    for the workers' ports. Without the Active Memory Manager, which may drop b's replica of ``x`` (and with it the
    lease on a's pool) at any moment after ``y`` ran, so that the table is the one the page shows."""
    code, shown = snippet()
    script = tmp_path / "snippet.py"
    script.write_text(code)
    env = {k: v for k, v in os.environ.items() if not k.startswith("DASK_GPUPOOL")}
    env["CUDA_VISIBLE_DEVICES"] = ""
    env["DASK_DISTRIBUTED__SCHEDULER__ACTIVE_MEMORY_MANAGER__START"] = "False"
    out = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=180, cwd=tmp_path, env=env
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert ports_left_out(out.stdout) == ports_left_out(shown), out.stdout


def test_the_readme_demo_runs_without_a_gpu_and_hands_over_zero_copy():
    """The README's first command: `python -m dask_gpupool demo` (host pools without a GPU, GPUs when present)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DASK_GPUPOOL")}
    out = subprocess.run(
        [sys.executable, "-m", "dask_gpupool", "demo"], capture_output=True, text=True, timeout=150, env=env
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.rstrip().endswith("OK"), out.stdout
    assert "zero-copy bytes received: 1,048,576, copied: 0" in out.stdout, out.stdout


def test_demo_options_that_cannot_work_are_a_clear_error_not_a_traceback():
    """``demo --max-size garbage`` raised ``ConfigError`` after starting a cluster, ``--kind device`` on a machine
    without a GPU and a size the workers cannot have raised the workers' ``ConfigError`` from ``register_plugin``:
    each a traceback and status 1. A bad size or a GPU kind without GPUs is refused before any cluster starts;
    a pool the workers cannot make is one line naming why, status 2."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DASK_GPUPOOL")}

    def demo(*args: str, **extra: str) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-m", "dask_gpupool", "demo", *args]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=150, env={**env, **extra})

    out = demo("--max-size", "garbage")
    assert out.returncode == 2 and out.stdout == "", out.stdout + out.stderr
    assert "Traceback" not in out.stderr and "--max-size" in out.stderr and "not a size" in out.stderr
    for kind in ("device", "pinned"):
        out = demo("--kind", kind, CUDA_VISIBLE_DEVICES="")
        assert out.returncode == 2 and out.stdout == "", out.stdout + out.stderr
        assert "Traceback" not in out.stderr and f"--kind {kind} needs a GPU" in out.stderr, out.stderr
    out = demo("--kind", "host", "--max-size", "1 PiB")  # more than the host has: each worker's setup fails
    assert out.returncode == 2, out.stdout + out.stderr
    # the demo's own line; under load a Nanny may still log its worker's shutdown after it
    said = [line for line in out.stderr.splitlines() if line.startswith("dask_gpupool demo:")]
    assert said, out.stderr
    refusal = "dask_gpupool demo: the workers could not make their pools: ConfigError: gpupool.max-size"
    assert said[-1].startswith(refusal), out.stderr
    assert "dask_gpupool/cli.py" not in out.stderr and "dask_gpupool/demo.py" not in out.stderr  # no traceback of ours


def test_the_operations_page_names_every_fallback_reason_and_timed_step():
    """docs/operations.rst is where "why did this copy?" and "where did the time go?" are answered: its table of
    reasons lacked ``retired-segment``, and its list of timed steps said ``import`` includes the claim (it does
    not: the claim is timed on its own) and left out the steps added since."""
    from dask_gpupool.handoff.stats import FALLBACK_REASONS, TIMED_STEPS

    text = (ROOT / "docs" / "operations.rst").read_text()
    assert set(re.findall(r"^   \* - ``([a-z-]+)``$", text, re.M)) == set(FALLBACK_REASONS)
    timings = re.search(r"Where does a handoff's time go\?\n-+\n(.*?)\n\S[^\n]*\n-{3,}", text, re.S).group(1)
    assert {step for step in TIMED_STEPS if f"``{step}``" not in timings} == set()
    assert "claim included" not in timings


def test_the_operations_page_lists_every_prometheus_metric():
    """docs/operations.rst lists each metric the collectors serve, under its full name."""
    from dask_gpupool.ops.metrics import _worker_metrics

    text = (ROOT / "docs" / "operations.rst").read_text()
    names = {m.name for m in _worker_metrics()} | {"dask_scheduler_gpupool_pools"}
    counters = {m.name for m in _worker_metrics() if m.type == "counter"}
    listed = {n.removesuffix("_total") for n in re.findall(r"``(dask_(?:worker|scheduler)_gpupool_[a-z_]+)``", text)}
    assert names - listed == set()
    assert {n for n in counters if f"``{n}_total``" not in text} == set()  # counters under their exposed name


LISTENING = """
import importlib.util, json, sys

import psutil
from distributed import Client

import dask_gpupool
from dask_gpupool import testing as T


def load(path):
    spec = importlib.util.spec_from_file_location("example", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def listening():
    me = psutil.Process()
    return sorted(
        {(c.laddr.ip, c.laddr.port) for p in (me, *me.children(recursive=True)) for c in p.net_connections("inet")
         if c.status == psutil.CONN_LISTEN}
    )


if __name__ == "__main__":
    which, root, brokers = sys.argv[1:]
    plugin = dask_gpupool.GPUPool(kind="host", max_size="64 MiB", broker_dir=brokers)
    if which == "demo":
        from dask_gpupool.demo import _local_cluster, _worker_specs

        cluster, client = _local_cluster(_worker_specs(0, 2)), None
    elif which == "zero_copy_handoff":
        cluster, client = load(f"{root}/examples/zero_copy_handoff.py").local_cluster(), None
    else:
        cluster, client = load(f"{root}/examples/etl_pipeline.py").cluster([{}, {}], plugin)
    with cluster, client or Client(cluster) as c:
        c.wait_for_workers(2)
        if client is None:
            c.register_plugin(plugin)
        addresses = {"scheduler": cluster.scheduler_address, "workers": sorted(T.workers(c))}
        addresses["listening"] = listening()
        rows = dask_gpupool.pools(c)
        addresses["pools"] = len(rows)
    # multiprocessing's resource tracker lives as long as this process, whatever it ran
    left = [p.cmdline() for p in psutil.Process().children(recursive=True)]
    addresses["left"] = [cmd for cmd in left if not any("resource_tracker" in part for part in cmd)]
    print(json.dumps(addresses))
"""


@pytest.mark.parametrize("which", ["demo", "zero_copy_handoff", "etl_pipeline"])
def test_the_demo_and_the_examples_listen_on_the_loopback_interface_only(which, tmp_path):
    """The demo's and the examples' clusters (scheduler, its dashboard, nannies, workers and their HTTP servers)
    listen on 127.0.0.1 only, as a LocalCluster does, not on the host's outside interfaces; and leave no process
    nor broker directory behind."""
    import json
    import tempfile

    script = tmp_path / "listening.py"
    script.write_text(LISTENING)
    with tempfile.TemporaryDirectory(prefix="brokers-") as brokers:  # short: a socket path under it fits AF_UNIX
        out = subprocess.run(
            [sys.executable, str(script), which, str(ROOT), brokers], capture_output=True, text=True, timeout=170
        )
        assert out.returncode == 0, out.stderr[-4000:]
        seen = json.loads(out.stdout.strip().splitlines()[-1])
        assert os.listdir(brokers) == []
    assert seen["listening"], seen
    outside = [ip for ip, _port in seen["listening"] if ip not in ("127.0.0.1", "::1")]
    assert outside == [], seen
    for address in (seen["scheduler"], *seen["workers"]):
        assert address.startswith("tcp://127.0.0.1:"), seen
    assert seen["pools"] == 2 and seen["left"] == [], seen


def test_every_test_the_docs_name_exists():
    """A node id on a docs page (``tests/...py::test_name``) names a test function defined in that file."""
    missing = []
    for page in sorted((ROOT / "docs").glob("*.*")):
        if page.suffix not in (".md", ".rst"):
            continue
        for path, name in re.findall(r"(tests/[\w/]+\.py)::(test_\w+)", page.read_text()):
            source = ROOT / path
            if not source.is_file() or not re.search(rf"^(?:async )?def {name}\(", source.read_text(), re.M):
                missing.append(f"{page.name}: {path}::{name}")
    assert missing == []


def test_the_configuration_page_describes_every_option_and_no_other():
    """docs/configuration.rst's table names each ``gpupool.*`` key of the schema once (the reference below it is
    generated from the schema at build time)."""
    import yaml

    schema = yaml.safe_load((ROOT / "dask_gpupool" / "gpupool-schema.yaml").read_text())
    keys = set(schema["properties"]["gpupool"]["properties"])
    text = (ROOT / "docs" / "configuration.rst").read_text()
    table = text[text.index("The options\n") : text.index("Reference\n")]
    rows = re.findall(r"^   \* - ``([a-z-]+)``$", table, re.M)
    assert sorted(rows) == sorted(keys)
