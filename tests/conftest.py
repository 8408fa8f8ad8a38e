from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from dask_gpupool import GPUPool
from dask_gpupool import testing as T
from dask_gpupool.memory.topology import local_devices
from dask_gpupool.tuning import HOST_HANDOFF_THRESHOLD


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """With ``GPUPOOL_FAILURES_LOG`` set, append each failure's report to that file as it happens.

    pytest prints failure bodies only once the run ends; a GPU-machine run cut off by its time limit
    (``scripts/gpu-check.sh``) would lose them.
    """
    path = os.environ.get("GPUPOOL_FAILURES_LOG")
    if path and report.failed:
        with open(path, "a") as f:
            f.write(f"==== {report.nodeid} ({report.when})\n{report.longreprtext}\n")
            for name, text in report.sections:
                f.write(f"---- {name}\n{text[-20000:]}\n")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if local_devices():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (none visible)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@contextlib.contextmanager
def nanny_cluster(
    workers: list[dict[str, Any]], plugin: Any = None, security: Any = None, **scheduler_options: Any
) -> Iterator[Any]:
    """A SpecCluster of real ``Nanny`` workers (one thread each) and a Client.

    Each entry of ``workers`` holds extra ``Nanny`` options, e.g.
    ``{"env": {"CUDA_VISIBLE_DEVICES": "1,0"}, "config": {"gpupool": {"host-id": "a"}}}``.
    Yields the client; with ``plugin`` given it is registered first.

    The Active Memory Manager's timer is off: tests that write into a
    producer's buffer after a handoff need the producer's replica to stay
    (ReduceReplicas may drop it, and a task pinned to the producer would then
    fetch a copy back from the consumer and write into that). A GPU run saw
    this once. Tests of the AMM make its requests themselves.
    """
    import dask
    from distributed import Client, Nanny, Scheduler, SpecCluster

    secured = {"security": security, "protocol": "tls"} if security is not None else {}
    specs = {
        f"w{i}": {"cls": Nanny, "options": {"nthreads": 1, "dashboard_address": None, **secured, **options}}
        for i, options in enumerate(workers)
    }
    scheduler = {"cls": Scheduler, "options": {"dashboard_address": ":0", **secured, **scheduler_options}}
    amm_off = dask.config.set({"distributed.scheduler.active-memory-manager.start": False})

    class Cluster(SpecCluster):
        def _update_worker_status(self, op: str, msg: Any) -> None:
            # dask/distributed#5407: a "remove" for a worker this cluster's view no longer (or never) lists, seen
            # when a Nanny restarted a SIGKILLed worker under load, raises KeyError at close.
            if op == "remove" and msg not in self.scheduler_info.get("workers", {}):
                return
            super()._update_worker_status(op, msg)

    with amm_off, Cluster(workers=specs, scheduler=scheduler, asynchronous=False, security=security) as cluster:
        with Client(cluster, security=security) as client:
            client.wait_for_workers(len(workers))
            if plugin is not None:
                client.register_plugin(plugin)
            yield client


def worker_addresses(client: Any) -> list[str]:
    """Worker addresses ordered by worker name (w0, w1, ...)."""
    from dask_gpupool import testing as T

    workers = T.workers(client)  # not scheduler_info(): see T.workers
    return [a for a, _ in sorted(workers.items(), key=lambda kv: str(kv[1]["name"]))]


def pid_of(client: Any, worker: str) -> int:
    """The pid of ``worker``'s process, from the pool registry."""
    import dask_gpupool

    return next(r.pid for r in dask_gpupool.pools(client) if r.worker == worker)


@pytest.fixture
def no_fd_leak() -> Iterator[None]:
    """Fails the test if it leaves more fds open in this process than it found (naming the new ones).

    The driver's own fds and those of each visible GPU's primary context are
    opened once per process and kept: they are opened first, so they are not
    counted against a test that happens to be the first to use a GPU (an
    importer makes its GPU current even for host pools).
    """
    import gc

    from dask_gpupool.memory.topology import current_gpu

    for ordinal in range(len(local_devices().uuids)):
        current_gpu(ordinal)
    gc.collect()
    before = fd_targets()
    yield
    gc.collect()
    after = fd_targets()
    new = sorted(target for fd, target in after.items() if before.get(fd) != target)
    assert len(after) <= len(before), f"the test leaked file descriptors in the test process: {new}"


def fd_targets() -> dict[str, str]:
    """This process's open fds and what each names (``socket:[inode]``, ``pipe:[inode]``, a path)."""
    out = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            out[fd] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            pass
    return out


def handoff_round_trip(client: Any, nbytes: int, data: bytes) -> dict[str, Any]:
    """Worker w0 writes ``data`` into its pool, w1 maps w0's pool and reads it (twice), both let go.

    Checks the bytes, that the pool was mapped once, and that every worker is back to its
    baseline afterwards: fds, sockets, memfds, broker connections, mapped pools, pool bytes.
    One warm-up round trip comes first: a process's first CUDA use opens driver fds that stay.
    Returns the registry rows by worker.
    """
    import dask_gpupool
    from dask_gpupool import testing as T

    a, b = worker_addresses(client)
    rows = {r.worker: r for r in dask_gpupool.pools(client)}

    def trip(key: str, size: int, payload: bytes, reads: int) -> dict[str, Any]:
        desc = client.submit(T.hold, key, size, payload, workers=[a], pure=False).result()
        for _ in range(reads):
            assert client.submit(T.read_peer, desc, len(payload), workers=[b], pure=False).result() == payload
        during = client.run(T.resources)
        client.submit(T.release, key, workers=[a], pure=False).result()
        client.submit(T.unmap, rows[a].pool, workers=[b], pure=False).result()
        return during

    trip("warm-up", 4096, b"w", 1)
    before = client.run(T.resources)
    during = trip("trip", nbytes, data, 2)
    assert during[b]["mapped_pools"] == 1  # mapped once, reused
    assert during[a]["used"] >= nbytes
    after = client.run(T.resources)
    assert after == before, f"not back to the baseline, (after, before) by worker: {resource_diff(after, before)}"
    return rows


def resource_diff(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    """What differs between two :func:`~dask_gpupool.testing.resources` snapshots, fd kinds one by one."""
    out: dict[str, Any] = {}
    for w, base in before.items():
        now = after.get(w, {})
        diff = {k: (now.get(k), v) for k, v in base.items() if k != "fd_kinds" and now.get(k) != v}
        kinds_now, kinds_base = now.get("fd_kinds", {}), base.get("fd_kinds", {})
        diff.update(
            {
                f"fd {k}": (kinds_now.get(k, 0), kinds_base.get(k, 0))
                for k in {*kinds_now, *kinds_base}
                if kinds_now.get(k, 0) != kinds_base.get(k, 0)
            }
        )
        if diff:
            out[w] = diff
    return out


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def stop_processes(procs: list[Any]) -> None:
    """Terminate the ``subprocess.Popen`` objects still running (last started first), then reap them all."""
    import subprocess

    for p in reversed(procs):
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(30)


# -- the registry, command-line, operations and registration tests ---------------------------

#: A small host pool whose brokers drop a connection that sends nothing for 2 s: the plugin of the tests of the
#: registry, the commands, the operations pages and the registrations.
PLUGIN = GPUPool(kind="host", max_size="64MiB", broker_timeout="2s")


@pytest.fixture(scope="module")
def client() -> Iterator[Any]:
    """Two workers with :data:`PLUGIN`, shared by the tests of a module (each leaves the cluster as it found it)."""
    with nanny_cluster([{}, {}], PLUGIN) as c:
        yield c


def by_worker(client: Any) -> dict[str, Any]:
    """The registry's rows by worker address."""
    import dask_gpupool

    return {r.worker: r for r in dask_gpupool.pools(client)}


def rejected_on_scheduler(client: Any, name: str = "gpupool") -> dict[str, int]:
    """The scheduler plugin's count of refused registry messages, by reason (test inspection only)."""

    def get(dask_scheduler: Any) -> dict[str, int]:
        return dict(getattr(dask_scheduler.plugins[name], "rejected", {}))

    return client.run_on_scheduler(get)


def cli(*args: str) -> Any:
    """``python -m dask_gpupool ARGS`` in a subprocess, its output captured (a ``subprocess.CompletedProcess``)."""
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "dask_gpupool", *args], capture_output=True, text=True, timeout=120)


def dashboard_base(client: Any, worker: str | None = None) -> str:
    """``http://host:port`` of ``worker``'s HTTP server (its dashboard's port), or of the scheduler's."""
    info = client.scheduler_info()
    host = info["address"].split("://")[1].rsplit(":", 1)[0]
    port = T.workers(client)[worker]["services"]["dashboard"] if worker else info["services"]["dashboard"]
    return f"http://{host}:{port}"


# -- the GPU layouts of the gpu-marked tests ------------------------------------------------

#: A worker on GPU 0 (two of them share it).
ONE_GPU = {"env": {"CUDA_VISIBLE_DEVICES": "0"}}
#: dask-cuda's layout on two GPUs: each worker's own GPU is its ordinal 0, and both GPUs are visible.
ROTATED = [{"env": {"CUDA_VISIBLE_DEVICES": "0,1"}}, {"env": {"CUDA_VISIBLE_DEVICES": "1,0"}}]


def gpus(n: int) -> None:
    """Skip unless ``n`` GPUs are visible, and CuPy (which the checks read device memory with) imports."""
    if len(local_devices().uuids) < n:
        pytest.skip(f"needs {n} GPUs, sees {len(local_devices().uuids)}")
    pytest.importorskip("cupy", reason="the GPU tests read device memory with CuPy")


def layout_workers(layout: str) -> list[dict]:
    """Two workers on one GPU, or one on each of two (skips when the GPUs are missing)."""
    gpus(2 if layout == "two-gpus" else 1)
    return ROTATED if layout == "two-gpus" else [ONE_GPU, ONE_GPU]


def pool_kinds(*layouts: str) -> pytest.MarkDecorator:
    """Parametrize a test's ``kind`` over ``host`` pools and, gpu-marked, ``device`` pools on each of ``layouts``
    (``one-gpu``, ``two-gpus``): ids ``host``, ``device-one-gpu``, ``device-two-gpus``. For the scenarios that
    hold on any pool; :func:`kind_cluster` makes the cluster."""
    kinds = [pytest.param(f"device-{layout}", marks=pytest.mark.gpu) for layout in layouts]
    return pytest.mark.parametrize("kind", ["host", *kinds])


def kind_cluster(kind: str, max_size: str | int, n: int = 2, **options: Any) -> Any:
    """:func:`nanny_cluster` of ``n`` workers with a pool of ``kind`` (from :func:`pool_kinds`), ``max_size`` and
    ``options``. ``device-one-gpu`` puts every worker on GPU 0; ``device-two-gpus`` makes them alternate between
    GPUs 0 and 1 (:data:`ROTATED`); a ``device`` kind skips without its GPUs or CuPy."""
    if kind == "host":
        workers: list[dict[str, Any]] = [{}] * n
    else:
        two = kind == "device-two-gpus"
        gpus(2 if two else 1)
        workers = [ROTATED[i % 2] for i in range(n)] if two else [ONE_GPU] * n
    return nanny_cluster(workers, GPUPool(kind=kind.split("-")[0], max_size=max_size, **options))


# -- cluster helpers shared by the multi-process tests ------------------------------------

#: A small host pool: the plugin most CPU tests register.
HOST_POOL = GPUPool(kind="host", max_size="64 MiB")


def wait_for(predicate: Callable[[], bool], timeout: float = 60.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def counters(client: Any, *workers: str) -> dict[str, dict[str, Any]]:
    return client.run(T.handoff_counters, workers=list(workers) or None)


def warm_up(client: Any, a: str, b: str, nbytes: int = HOST_HANDOFF_THRESHOLD) -> dict[str, Any]:
    """One handoff each way of an ``nbytes`` buffer (opens links and mappings that then stay); returns the resource
    baseline, taken once the warm-up's leases ended and Dask forgot its values. The default is the smallest
    ``host``-pool buffer handed over rather than copied."""
    keys = []
    for src, dst in ((a, b), (b, a)):
        x = client.submit(T.make_buffer, nbytes, b"w", workers=[src], pure=False)
        client.submit(T.head, x, 1, workers=[dst], pure=False).result()
        keys.append(x.key)
        del x
    wait_for(lambda: all(c["leases"] == 0 for c in counters(client).values()), what="warm-up leases to end")
    wait_forgotten(client, keys)
    return client.run(T.resources)


def wait_forgotten(client: Any, keys: list[Any]) -> None:
    """Wait until no worker holds ``keys`` (released by the client). Dask forgets released keys asynchronously: a
    resource baseline taken before would count their buffers."""

    def held(dask_worker: Any) -> list[Any]:
        return [k for k in keys if k in dask_worker.data]

    wait_for(lambda: not any(client.run(held).values()), what="the released values to be forgotten")


def back_to(client: Any, baseline: dict[str, Any], timeout: float = 60.0, workers: list[str] | None = None) -> None:
    """Wait until the workers' resources equal ``baseline``; on timeout, fail naming what differs.

    ``baseline`` maps worker address to :func:`~dask_gpupool.testing.resources`; with ``workers``
    only those are compared (for example the survivors of a kill).
    """
    deadline = time.monotonic() + timeout
    now = client.run(T.resources, workers=workers)
    while now != baseline and time.monotonic() < deadline:
        time.sleep(0.1)
        now = client.run(T.resources, workers=workers)
    diff = {
        w: {k: (now.get(w, {}).get(k), v) for k, v in base.items() if now.get(w, {}).get(k) != v}
        for w, base in baseline.items()
    }
    assert now == baseline, f"not back to the baseline, (now, baseline) by worker: {diff}"


def kill_the_middle_of_a_chain(c: Any, a: str, b: str, w: str, nbytes: int, scribble: int) -> None:
    """A's Buffer goes A -> B -> W (W maps A's memory under a lease A granted through B); B is SIGKILLed.

    Checks that A ends B's lease and keeps W's, and that W reads the right bytes after A's key is gone and A's
    pool was scribbled over (four buffers of ``scribble`` bytes). Leaves W's key in place until it returns.
    """
    x = c.submit(T.make_buffer, nbytes, b"survives", workers=[a], pure=False)
    y = c.submit(T.keep, x, workers=[b], pure=False)
    z = c.submit(T.keep, y, workers=[w], pure=False)
    z.result()
    assert counters(c, a)[a]["leases"] == 2
    os.kill(pid_of(c, b), signal.SIGKILL)
    wait_for(lambda: counters(c, a)[a]["leases"] == 1, what="A to end the dead middle worker's lease")
    del x
    for _ in range(4):
        c.submit(T.scribble_all, scribble, ord("S"), workers=[a], pure=False).result()
    assert c.submit(T.head, z, 8, workers=[w], pure=False).result() == b"survives"


def kill_consumer_holding_leases(c: Any, a: str, b: str, xs: list[Any]) -> None:
    """B keeps every key of ``xs`` (A's results, so B imports them), is SIGKILLed, and A releases all the leases."""
    ys = [c.submit(T.keep, x, workers=[b], pure=False) for x in xs]
    c.gather(ys)
    assert counters(c, a)[a]["leases"] == len(xs)
    os.kill(pid_of(c, b), signal.SIGKILL)
    wait_for(lambda: counters(c, a)[a]["leases"] == 0, what=f"A to release the dead consumer's {len(xs)} leases")


def stress(c, rounds: int, nbytes: int) -> int:
    """Producers drop their keys while consumers still read; freed memory is scribbled over at once.

    ``rounds`` rounds of 8 handoffs, each one zero-copy (checked: a copy would prove nothing). A
    use-after-free shows as wrong bytes, or (across GPUs) as CUDA_ERROR_CONTAINED killing the consumer.
    """
    a, b = worker_addresses(c)
    baseline = warm_up(c, a, b)
    before = counters(c, b)[b]["zero_copy_bytes"]
    for r in range(rounds):
        values = [(r * 8 + i) % 250 + 1 for i in range(8)]
        xs = [c.submit(T.fill, nbytes, v, workers=[a], pure=False) for v in values]
        ys = [c.submit(T.keep, x, workers=[b], pure=False) for x in xs]
        c.gather([c.submit(T.head, y, 1, workers=[b], pure=False) for y in ys])
        for x in xs:
            x.release()
        scribbles = [c.submit(T.scribble_all, nbytes, 0, workers=[a], pure=False) for _ in values]
        checks = [c.submit(T.all_equal, y, v, workers=[b], pure=False) for y, v in zip(ys, values, strict=True)]
        assert all(c.gather(checks)), f"round {r}: a consumer read memory its producer reused"
        c.gather(scribbles)
        del xs, ys, checks, scribbles
    assert counters(c, b)[b]["zero_copy_bytes"] - before == rounds * 8 * nbytes  # every handoff mapped
    back_to(c, baseline)
    return rounds


# -- the stalled-process cases of the lease tests, on any pool kind (tests/handoff/test_leases.py)


def stalled_consumer(c: Any, nbytes: int, stop: float = 3.0) -> None:
    """Case 1 on any pool kind: the cluster's ``lease-timeout`` should be well under ``stop`` seconds."""
    a, b = worker_addresses(c)
    baseline = warm_up(c, a, b)
    x = c.submit(T.make_buffer, nbytes, b"original", workers=[a], pure=False)
    x.result()
    c.run(T.block_imports, stop + 2, workers=[b])  # B's import waits, then claims: stop + 2 s after this
    y = c.submit(T.keep, x, workers=[b], pure=False)
    wait_for(lambda: c.run(T.lease_counts, workers=[a])[a]["unclaimed"] == 1, what="A to grant B a lease")
    pid_b = pid_of(c, b)
    os.kill(pid_b, signal.SIGSTOP)
    try:
        time.sleep(stop)
    finally:
        os.kill(pid_b, signal.SIGCONT)
    y.result(timeout=60)
    assert c.submit(T.describe, y, workers=[b], pure=False).result()["imported"]
    # A drops its key and reuses every byte of its pool it can
    del x
    wait_for(lambda: c.run(T.lease_counts, workers=[a])[a]["leases"] == 1, what="A's key to go")
    for _ in range(8):
        c.submit(T.scribble_all, nbytes, ord("S"), workers=[a], pure=False).result()
    assert c.submit(T.head, y, 8, workers=[b], pure=False).result() == b"original"
    del y
    back_to(c, baseline)


def stalled_producer(c: Any, nbytes: int, stop: float = 3.0) -> None:
    """Case 2 on any pool kind: the cluster's ``broker-timeout`` should be well under ``stop`` seconds."""
    a, b = worker_addresses(c)
    baseline = warm_up(c, a, b)
    z = c.submit(T.make_buffer, nbytes, b"keep me!", workers=[a], pure=False)
    kept = c.submit(T.keep, z, workers=[b], pure=False)
    # handed over, not copied: host pools copy smaller buffers
    xs = [c.submit(T.make_buffer, HOST_HANDOFF_THRESHOLD, b"x", workers=[a], pure=False) for _ in range(300)]
    ys = [c.submit(T.keep, x, workers=[b], pure=False) for x in xs]
    c.gather(ys)
    kept.result()
    assert c.run(T.lease_counts, workers=[a])[a]["leases"] == 301
    pid_a = pid_of(c, a)
    os.kill(pid_a, signal.SIGSTOP)
    try:
        for x, y in zip(xs, ys, strict=True):  # one release message each, until A's socket buffer is full
            x.release()  # B's replica of x is the same import as y
            y.release()
            time.sleep(0.01)
        del xs, ys
        time.sleep(stop)  # B's send times out and its link closes
    finally:
        os.kill(pid_a, signal.SIGCONT)
    wait_for(lambda: c.run(T.lease_counts, workers=[a])[a]["leases"] == 1, what="A to end the released leases")
    assert c.run(T.lease_counts, workers=[b])[b]["resyncs"] >= 1
    del z
    for _ in range(64):
        c.submit(T.scribble_all, max(nbytes, 4 << 20), ord("S"), workers=[a], pure=False).result()
    assert c.submit(T.head, kept, 8, workers=[b], pure=False).result() == b"keep me!"
    del kept
    back_to(c, baseline)


def assert_the_collector_collects() -> None:
    """Fail if ``gc.collect()`` collects no cycle here: a collection stuck on another thread (a finalizer that
    deadlocked in an earlier test) makes every later collection in the process return at once, so buffers in cycles
    are never freed, and a used-bytes check then fails for a reason that is not the pool's (461 MB counted used in
    the ``[arena]`` garbage-collector test on an H100, run after the ``[rmm]`` case deadlocked inside a collection)."""
    import gc
    import weakref

    class Canary:
        pass

    canary = Canary()
    ref = weakref.ref(canary)
    cycle: list[Any] = [canary, None]
    cycle[1] = cycle
    del canary, cycle
    gc.collect()
    assert ref() is None, "gc.collect() collected nothing: a collection is stuck on another thread (earlier deadlock)"


def run_with_frequent_collections(step: Callable[[], None], timeout: float = 30.0, rounds: int = 500) -> None:
    """Call ``step()`` over and over in a thread, with the collector's threshold at several small values (and the
    default), so that collections, and the finalizers of garbage cycles, run at many points inside the pool's own
    calls; fail if the thread does not finish within ``timeout``."""
    import gc
    import threading

    assert_the_collector_collects()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            for threshold in (*range(2, 12), 700):
                gc.set_threshold(threshold)
                for _ in range(rounds):
                    step()
        except BaseException as e:
            errors.append(e)

    before = gc.get_threshold()
    try:
        t = threading.Thread(target=run, daemon=True)
        t.start()
        t.join(timeout)
    finally:
        gc.set_threshold(*before)
    assert not t.is_alive(), "an allocation deadlocked: the collector freed a pool buffer inside the pool's lock"
    assert not errors, errors
