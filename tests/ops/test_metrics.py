"""The Prometheus metrics on Dask's own ``/metrics`` endpoints, of workers and the scheduler."""

from __future__ import annotations

import os
import re
import subprocess

import pytest
from conftest import (
    PLUGIN,
    dashboard_base,
    nanny_cluster,
    worker_addresses,
)

import dask_gpupool
from dask_gpupool import testing as T

MiB = 1 << 20


def test_prometheus_metrics_on_dasks_own_endpoints():
    pytest.importorskip("prometheus_client")
    import urllib.request

    from conftest import warm_up

    def scrape(host: str, port: int) -> str:
        with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=10) as r:
            return r.read().decode()

    with nanny_cluster([{"dashboard_address": ":0"}] * 2, PLUGIN) as c:
        a, b = worker_addresses(c)
        warm_up(c, a, b)
        # a small buffer held on B: its page stays resident (freed buffers from 64 KiB give theirs back at once)
        held = c.submit(T.make_buffer, 4096, b"held", workers=[b], pure=False)
        held.result()
        info = c.scheduler_info()
        host = info["address"].split("://")[1].rsplit(":", 1)[0]
        text = scrape(host, T.workers(c)[b]["services"]["dashboard"])
        samples = [line for line in text.splitlines() if line.startswith("dask_worker_gpupool_")]

        def sample(name: str, label: str) -> list[str]:
            return [line for line in samples if line.startswith(name + "{") and label in line]

        assert sample("dask_worker_gpupool_received_bytes_total", 'path="zero-copy"')
        assert sample("dask_worker_gpupool_pool_bytes", 'state="used"') and 'reason="other-gpu"' in text
        # pool_bytes summed over ``state`` is what the pool reserves (used, and free: reserved, in no live buffer);
        # the limit is a metric of its own, not a ``state`` to be summed with them
        states = {
            re.search(r'state="(\w+)"', line).group(1): float(line.rsplit(" ", 1)[1])
            for line in sample("dask_worker_gpupool_pool_bytes", "w1")
        }
        assert set(states) == {"used", "free"}, states
        assert sum(states.values()) == dask_gpupool.pool_stats(c)[b]["reserved"] > 0
        limit = [float(line.rsplit(" ", 1)[1]) for line in sample("dask_worker_gpupool_pool_limit_bytes", "w1")]
        assert limit == [64 * MiB]
        assert sample("dask_worker_gpupool_segments", 'state="retiring"')
        assert [line.rsplit(" ", 1)[1] for line in sample("dask_worker_gpupool_leases_in_doubt", "w1")] == ["0.0"]
        # what stats() counts beside the handoffs: arrays staged into the pool, device memory kept out of reuse
        # after a UCX transfer that did not complete (both 0 here: host pools stage nothing, and TCP has no quarantine)
        assert [line.rsplit(" ", 1)[1] for line in sample("dask_worker_gpupool_staged_bytes_total", "w1")] == ["0.0"]
        assert [line.rsplit(" ", 1)[1] for line in sample("dask_worker_gpupool_ucx_quarantined_bytes", "w1")] == ["0.0"]
        # labelled by the worker's name, which a restarted worker keeps, not by its pool's UUID
        assert samples and all('worker="w1"' in line and "pool=" not in line for line in samples)
        imported = sample("dask_worker_gpupool_handoffs_total", 'direction="import"')
        assert imported and float(imported[0].rsplit(" ", 1)[1]) >= 1
        assert sample("dask_worker_gpupool_handoffs_total", 'direction="forward"')
        assert sample("dask_worker_gpupool_handoffs_total", 'direction="return"')
        text = scrape(host, info["services"]["dashboard"])
        assert 'dask_scheduler_gpupool_pools{kind="host"} 2.0' in text


def scrape_metrics(client, worker=None):
    """The text of ``/metrics`` on ``worker`` (its dashboard's port), or on the scheduler."""
    import urllib.request

    with urllib.request.urlopen(dashboard_base(client, worker) + "/metrics", timeout=10) as r:
        return r.read().decode()


def metric_help(text: str, name: str) -> str:
    return re.search(rf"^# HELP {name} (.*)$", text, re.M).group(1)


def metric_value(text: str, name: str, labels: str) -> float:
    return float(re.search(rf"^{name}{{{labels}}} (\S+)$", text, re.M).group(1))


def test_prometheus_help_says_what_the_copy_counters_count():
    """``received_bytes`` said "from same-host peers" but its ``copy`` path counts copies from any sender, other
    hosts included; ``sent_copy_bytes`` said "to peers" but counts copies to workers of other hosts and to clients
    too. Both are seen counting those here, and their help says so."""
    pytest.importorskip("prometheus_client")
    hosts = [{"dashboard_address": ":0", "config": {"gpupool": {"host-id": host}}} for host in ("host-a", "host-b")]
    with nanny_cluster(hosts, PLUGIN) as c:
        a, b = worker_addresses(c)
        x = c.submit(T.make_buffer, MiB, b"x", workers=[a], pure=False)
        assert c.submit(T.head, x, 1, workers=[b], pure=False).result() == b"x"  # a copy: w1 is on another host
        received = scrape_metrics(c, b)
        assert metric_value(received, "dask_worker_gpupool_received_bytes_total", 'path="copy",worker="w1"') == MiB
        help_text = metric_help(received, "dask_worker_gpupool_received_bytes_total")
        assert "from same-host peers" not in help_text, help_text
        assert "any sender" in help_text and "other hosts" in help_text, help_text
        y = c.submit(T.make_buffer, MiB, b"y", workers=[a], pure=False)  # on w0 alone (w1 holds a replica of x)
        c.gather(y)  # the client's copy
        sent = scrape_metrics(c, a)
        assert metric_value(sent, "dask_worker_gpupool_sent_copy_bytes_total", 'worker="w0"') == 2 * MiB
        help_text = metric_help(sent, "dask_worker_gpupool_sent_copy_bytes_total")
        assert all(who in help_text for who in ("other hosts", "clients", "spill")), help_text


IN_ONE_PROCESS = """
import json, sys, urllib.request
import dask
from distributed import Client, LocalCluster
import dask_gpupool

def scrape(port):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return [line for line in r.read().decode().splitlines() if line.startswith("dask_") and "_gpupool_" in line]

if __name__ == "__main__":
    options = dict(n_workers=2, threads_per_worker=1, processes=False, protocol="tcp", host="127.0.0.1")
    with LocalCluster(dashboard_address=":0", worker_dashboard_address=":0", **options) as cluster:
        with Client(cluster) as c:
            c.register_plugin(dask_gpupool.GPUPool(kind="host", max_size="64MiB"))
            info = c.scheduler_info()
            out = {"scheduler": scrape(info["services"]["dashboard"])}
            out.update({str(w["name"]): scrape(w["services"]["dashboard"]) for w in info["workers"].values()})
            print(json.dumps(out))
"""


def test_several_workers_in_one_process_serve_each_series_once(tmp_path):
    """Workers of one process (``LocalCluster(processes=False)``) share one Prometheus registry: every worker's
    ``/metrics`` (and the scheduler's) served every worker's series, and the process-wide ``ucx_quarantined_bytes``
    once per worker, so sums over the endpoints counted them several times. Each endpoint now serves its own
    worker's series, the scheduler's its own, and a process-wide figure comes once per process."""
    import json
    import sys

    pytest.importorskip("prometheus_client")
    script = tmp_path / "in_one_process.py"
    script.write_text(IN_ONE_PROCESS)
    env = {k: v for k, v in os.environ.items() if not k.startswith("DASK_GPUPOOL")}
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    by_endpoint = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(by_endpoint) == {"scheduler", "0", "1"}
    assert by_endpoint["scheduler"] and all(s.startswith("dask_scheduler_") for s in by_endpoint["scheduler"])
    for worker in ("0", "1"):
        assert by_endpoint[worker] and all(f'worker="{worker}"' in s for s in by_endpoint[worker]), worker
    served = [s.rsplit(" ", 1)[0] for samples in by_endpoint.values() for s in samples]
    assert len(served) == len(set(served))  # each series on one endpoint only
    quarantined = [s for s in served if s.startswith("dask_worker_gpupool_ucx_quarantined_bytes{")]
    assert len(quarantined) == 1, quarantined  # once per process, under one of its workers
