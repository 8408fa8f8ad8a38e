"""Registering ``GPUPool`` on a running cluster: again, over a failed one, at the same moment from several
clients, while workers die, stop or join, under names of its own, and unregistering it. Each case ends with
one plugin serving everywhere (or none), nothing refused and nothing left behind."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time

import pytest
from conftest import (
    PLUGIN,
    by_worker,
    handoff_round_trip,
    nanny_cluster,
    rejected_on_scheduler,
    stop_processes,
    wait_for,
    worker_addresses,
)

import dask_gpupool
from dask_gpupool import GPUPool
from dask_gpupool import testing as T

MiB = 1 << 20


def test_registering_the_plugin_again_replaces_every_pool_and_refuses_nothing():
    """``client.register_plugin(GPUPool(...))`` again, with new options, on a running cluster: every worker gets a
    new pool with the new options, the old pools leave the registry and their broker directories go, and the old
    pools' own unregistrations are not refused as a worker acting as another (no false alarm in ``rejected``)."""
    with nanny_cluster([{}, {}], PLUGIN) as c:
        old = by_worker(c)
        c.register_plugin(GPUPool(kind="host", max_size="32MiB", broker_timeout="2s"))
        new = by_worker(c)
        assert set(new) == set(old) and {r.max_size for r in new.values()} == {32 * MiB}
        assert not {r.pool for r in new.values()} & {r.pool for r in old.values()}
        handoff_round_trip(c, MiB, b"registered again")
        wait_for(lambda: not any(os.path.exists(os.path.dirname(r.broker)) for r in old.values()))
        assert rejected_on_scheduler(c) == {}


def pool_count(client):
    """How many pools the registry lists; 0 while the scheduler has no registry."""
    try:
        return len(dask_gpupool.pools(client))
    except dask_gpupool.PoolUnavailableError:
        return 0


def test_a_failed_registration_over_a_running_plugin_leaves_none_so_a_preloading_worker_installs_it(tmp_path):
    """``client.register_plugin(GPUPool(...))`` again with options that fail on the workers raises, and tears down
    the pools of the plugin it replaced: the cluster is then left without the plugin, not with the old one
    listed on the scheduler and serving nothing, so that a worker started with ``--preload dask_gpupool``
    installs it again (its registration is idempotent)."""
    import sys

    with nanny_cluster([{}, {}], PLUGIN) as c:
        old = by_worker(c)
        with pytest.raises(dask_gpupool.ConfigError, match=r"gpupool\.broker-dir=.*missing"):
            c.register_plugin(GPUPool(kind="host", max_size="64MiB", broker_dir=str(tmp_path / "missing")))
        with pytest.raises(dask_gpupool.PoolUnavailableError):
            dask_gpupool.pools(c)
        assert not any(os.path.exists(os.path.dirname(r.broker)) for r in old.values())
        env = {**os.environ, "DASK_GPUPOOL__KIND": "host", "DASK_GPUPOOL__MAX_SIZE": "32MiB"}
        worker = [sys.executable, "-m", "distributed.cli.dask_worker", c.scheduler.address, "--nthreads", "1"]
        with open(tmp_path / "late-worker.log", "w") as log:
            procs = [subprocess.Popen([*worker, "--no-dashboard", "--preload", "dask_gpupool"], env=env, stderr=log)]
        try:
            c.wait_for_workers(3, timeout=60)
            wait_for(lambda: pool_count(c) == 3, timeout=60)
            assert not {r.pool for r in dask_gpupool.pools(c)} & {r.pool for r in old.values()}
        finally:
            stop_processes(procs)
        wait_for(lambda: len(dask_gpupool.pools(c)) == 2, timeout=60)
        handoff_round_trip(c, MiB, b"installed again")


def listed_gpupools(client):
    """The names under which the scheduler lists a ``GPUPool``, with each one's ``max_size`` option."""

    def on_scheduler(dask_scheduler):
        return {n: p.overrides.get("max_size") for n, p in dask_scheduler.plugins.items() if isinstance(p, GPUPool)}

    return client.run_on_scheduler(on_scheduler)


def registration_state(client, name="gpupool"):
    """Where the cluster's gpupool registration stands (test inspection only), by the ``max_size`` option of each
    plugin: on the scheduler, the plugin listed under ``name``, every name a ``GPUPool`` is listed under, whether its
    registry is the one the handlers serve, the worker plugin new workers get, and the listed registry's rows
    (worker -> pool); on each worker, its plugin, its pool, and whether the worker's registry stream handlers are
    that plugin's (its ``RegistryMember``'s)."""

    def on_scheduler(dask_scheduler):
        from distributed.protocol.pickle import loads

        from dask_gpupool.core import JOINED_OP, REGISTER_OP, UNREGISTER_OP

        listed = dask_scheduler.plugins.get(name)
        handlers = [dask_scheduler.handlers["gpupool_pools"]]
        handlers += [dask_scheduler.stream_handlers[op] for op in (REGISTER_OP, JOINED_OP, UNREGISTER_OP)]
        return {
            "listed": listed.overrides.get("max_size"),
            "names": sorted(n for n, p in dask_scheduler.plugins.items() if isinstance(p, GPUPool)),
            "serves": all(getattr(h, "__self__", None) is listed._registry_handlers for h in handlers),
            "worker-plugin": loads(dask_scheduler.worker_plugins["gpupool"]).overrides.get("max_size"),
            "rows": {r.worker: r.pool for r in listed.registry.records()},
        }

    def on_worker(dask_worker):
        from dask_gpupool.core import MEMBERSHIP_OP, REGISTRY_OP

        plugin = dask_worker.plugins.get("gpupool")
        service = getattr(plugin, "service", None)
        return {
            "plugin": getattr(plugin, "overrides", {}).get("max_size"),
            "pool": None if service is None else service.pool.uuid,
            "handlers": all(
                getattr(dask_worker.stream_handlers.get(op), "__self__", None) is getattr(plugin, "_member", None)
                for op in (MEMBERSHIP_OP, REGISTRY_OP)
            ),
        }

    return client.run_on_scheduler(on_scheduler), client.run(on_worker)


def broker_dirs(path):
    return sorted(d for d in os.listdir(path) if d.startswith("dask-gpupool-"))


def assert_one_plugin(client, size, broker_dir, name="gpupool"):
    """The whole cluster runs the GPUPool of ``max_size=size``: the scheduler lists it under ``name`` and no other
    GPUPool, its handlers serve the registry, new workers get its worker plugin; every worker runs its pool and no
    other (``broker_dir`` holds the live pools' broker directories only); the registry holds exactly the live
    workers' rows, of those pools."""
    on_scheduler, on_workers = registration_state(client, name)
    state = {"scheduler": on_scheduler, "workers": on_workers, "rows": dask_gpupool.pools(client)}
    assert on_scheduler["names"] == [name], state
    assert on_scheduler["listed"] == on_scheduler["worker-plugin"] == size, state
    assert on_scheduler["serves"], state
    assert {w: (s["plugin"], s["handlers"]) for w, s in on_workers.items()} == dict.fromkeys(
        on_workers, (size, True)
    ), state
    rows = by_worker(client)
    assert set(rows) == set(on_workers) == set(worker_addresses(client))
    assert {w: r.pool for w, r in rows.items()} == on_scheduler["rows"] == {w: s["pool"] for w, s in on_workers.items()}
    assert {r.max_size for r in rows.values()} == {int(size.removesuffix("MiB")) * MiB}
    live = sorted(os.path.basename(os.path.dirname(r.broker)) for r in rows.values())
    with contextlib.suppress(AssertionError):  # a torn-down pool's directory may take a moment to go
        wait_for(lambda: broker_dirs(broker_dir) == live, timeout=10)
    assert broker_dirs(broker_dir) == live


def assert_a_killed_workers_row_leaves(client, size, broker_dir):
    """Kill w0: its row leaves the registry, and the Nanny's new worker joins with the same plugin's pool."""
    victim = by_worker(client)[worker_addresses(client)[0]]
    os.kill(victim.pid, signal.SIGKILL)
    wait_for(lambda: victim.pool not in {r.pool for r in dask_gpupool.pools(client)}, timeout=60)
    wait_for(lambda: len(dask_gpupool.pools(client)) == 2, timeout=60)
    from dask_gpupool.transport.broker_dirs import remove_stale_broker_dirs

    remove_stale_broker_dirs(broker_dir, min_age=0)  # the killed broker's own directory (as in the kill test above)
    assert_one_plugin(client, size, broker_dir)


def register_from_threads(client, plugins, start=None):
    """Each of ``plugins`` registered by a client of its own, each from a thread: all at the same moment (a barrier),
    or, with ``start`` given, each once ``start(i)`` returned. What each ``register_plugin`` raised, or ``None``."""
    import threading

    from distributed import Client

    clients = [Client(client.scheduler.address, timeout=30) for _ in plugins]
    outcomes = [None] * len(plugins)
    barrier = threading.Barrier(len(plugins)) if start is None else None

    def register(i):
        if barrier is not None:
            barrier.wait(30)
        try:
            clients[i].register_plugin(plugins[i])
        except BaseException as e:
            outcomes[i] = e

    try:
        threads = [threading.Thread(target=register, args=(i,)) for i in range(len(plugins))]
        for i, t in enumerate(threads):
            if start is not None:
                start(i)
            t.start()
        for t in threads:
            t.join(120)
        assert not any(t.is_alive() for t in threads), "register_plugin did not return"
    finally:
        for other in clients:
            other.close()
    return outcomes


def test_two_registrations_at_once_with_other_options_leave_the_later_one_on_the_scheduler_and_every_worker(tmp_path):
    """Two clients register ``GPUPool`` with other sizes, the second while the first's start is still installing its
    worker plugins. The interleaving that left the workers with pools of both plugins is forced: worker w0 gets to
    install the first plugin only after the second (it holds the first one's ``plugin-add`` until the second's is
    answered, or 5 s); w1 installs them as they come. Registrations run one after the other, in the order the
    scheduler received them, as two registrations made in turn do: both ``register_plugin`` calls return, and the
    later one replaces the first everywhere (one plugin listed, serving the registry, installed on every worker;
    one pool per worker); a worker killed afterwards leaves the registry, and its restarted worker joins with the
    same plugin. Nothing is refused, and no broker directory is left."""
    plugins = [
        GPUPool(kind="host", max_size=size, broker_timeout="2s", broker_dir=str(tmp_path))
        for size in ("32MiB", "16MiB")
    ]
    with nanny_cluster([{}, {}]) as c:
        w0, _ = worker_addresses(c)
        c.run(T.hold_plugin_add, "32MiB", "16MiB", 5.0, workers=[w0])

        def start(i):
            if i == 1:  # the second registration goes once the first one's plugin-add is held on w0
                wait_for(lambda: c.run(T.plugin_adds, workers=[w0])[w0] == ["held 32MiB"])

        assert register_from_threads(c, plugins, start) == [None, None]
        seen = c.run(T.plugin_adds, workers=[w0])[w0]
        c.run(T.release_plugin_add, workers=[w0])
        assert_one_plugin(c, "16MiB", tmp_path)
        assert seen == ["held 32MiB", "add 32MiB", "add 16MiB"], seen  # the second waited for the first
        assert_a_killed_workers_row_leaves(c, "16MiB", tmp_path)
        handoff_round_trip(c, MiB, b"registered at once")
        assert rejected_on_scheduler(c) == {}
    assert os.listdir(tmp_path) == []


def test_two_clients_registering_other_options_at_the_same_moment_leave_one_plugin_everywhere(tmp_path):
    """Two clients call ``register_plugin(GPUPool(...))`` with other sizes at the same moment (no forced order): both
    return, and whichever the scheduler received last is the plugin listed, serving the registry and installed on
    every worker; a killed worker's row leaves the registry; nothing is refused, no broker directory is left."""
    sizes = ("32MiB", "16MiB")
    plugins = [GPUPool(kind="host", max_size=size, broker_timeout="2s", broker_dir=str(tmp_path)) for size in sizes]
    with nanny_cluster([{}, {}]) as c:
        assert register_from_threads(c, plugins) == [None, None]
        size = registration_state(c)[0]["listed"]
        assert size in sizes
        assert_one_plugin(c, size, tmp_path)
        assert_a_killed_workers_row_leaves(c, size, tmp_path)
        handoff_round_trip(c, MiB, b"registered at the same moment")
        assert rejected_on_scheduler(c) == {}
    assert os.listdir(tmp_path) == []


def test_two_installs_of_the_worker_plugin_at_once_leave_that_worker_one_pool(tmp_path):
    """A worker gets a gpupool worker plugin while another one's set-up has not ended (a worker joining while a
    registration is broadcast gets the plugin the scheduler gave it and the broadcast one): Dask tears the first
    down, installs the second, and the first's set-up goes on after (forced here: it waits until the second is
    installed). The worker ends with the second plugin's pool alone, registered and serving; the first's pool is not
    left running, unlisted, with its broker and its stream handlers; nothing is refused, no broker directory is
    left."""
    options = {"kind": "host", "broker_timeout": "2s", "broker_dir": str(tmp_path)}
    with nanny_cluster([{}, {}], GPUPool(max_size="16MiB", **options)) as c:
        w0, _ = worker_addresses(c)

        async def install_two(dask_worker):
            import asyncio

            from dask_gpupool.dask.worker_plugin import GPUPoolWorkerPlugin

            replaced = asyncio.Event()

            class SetUpLate(GPUPoolWorkerPlugin):
                async def setup(self, worker):
                    await replaced.wait()
                    await super().setup(worker)

            first = SetUpLate({**options, "max_size": "32MiB"})
            second = GPUPoolWorkerPlugin({**options, "max_size": "16MiB"})
            installing = asyncio.ensure_future(dask_worker.plugin_add(first, name="gpupool"))
            while dask_worker.plugins.get("gpupool") is not first:
                await asyncio.sleep(0.01)
            added = await dask_worker.plugin_add(second, name="gpupool")
            replaced.set()
            return [(await installing)["status"], added["status"]], dask_worker.plugins["gpupool"] is second

        old = by_worker(c)[w0].pool
        assert c.run(install_two, workers=[w0])[w0] == (["OK", "OK"], True)
        wait_for(lambda: getattr(by_worker(c).get(w0), "pool", old) != old)  # w0's row leaves, then the new one joins
        assert_one_plugin(c, "16MiB", tmp_path)
        handoff_round_trip(c, MiB, b"installed twice at once")
        assert rejected_on_scheduler(c) == {}
    assert os.listdir(tmp_path) == []


def test_a_worker_killed_while_a_registration_waits_for_the_others_leaves_the_new_registry(tmp_path):
    """A worker dies while ``register_plugin(GPUPool(...))`` still runs: w1 joined the new registry, w0's install is
    held, and w1 is killed. Distributed tells only the plugins it lists of a worker leaving, and the new one is
    listed only when its start returns; its registry drops the dead worker's row then. The registry holds exactly
    the live workers' rows (the Nanny's new w1 joins), and nothing is left behind."""
    import threading

    plugin = GPUPool(kind="host", max_size="16MiB", broker_timeout="2s", broker_dir=str(tmp_path))
    with nanny_cluster([{}, {}]) as c:
        w0, w1 = worker_addresses(c)
        c.run(T.hold_plugin_add, "16MiB", "none", 60.0, workers=[w0])
        outcome = []
        thread = threading.Thread(target=lambda: outcome.append(c.register_plugin(plugin)))
        thread.start()
        try:
            wait_for(lambda: c.run(T.plugin_adds, workers=[w0])[w0] == ["held 16MiB"])
            wait_for(lambda: w1 in by_worker(c))
            os.kill(by_worker(c)[w1].pid, signal.SIGKILL)
            wait_for(lambda: not c.run_on_scheduler(lambda dask_scheduler: w1 in dask_scheduler.workers))
        finally:
            c.run(T.release_plugin_add, workers=[w0])
            thread.join(120)
        assert outcome == [None]
        wait_for(lambda: len(worker_addresses(c)) == 2 and set(worker_addresses(c)) <= set(by_worker(c)), timeout=60)
        assert set(by_worker(c)) == set(worker_addresses(c))  # the dead w1's row is not among them
        from dask_gpupool.transport.broker_dirs import remove_stale_broker_dirs

        remove_stale_broker_dirs(str(tmp_path), min_age=0)  # the killed broker's own directory
        assert_one_plugin(c, "16MiB", tmp_path)
        handoff_round_trip(c, MiB, b"after a death during registration")
        assert rejected_on_scheduler(c) == {}
    assert os.listdir(tmp_path) == []


def test_two_idempotent_registrations_at_once_install_the_plugin_once(tmp_path):
    """Two ``GPUPool`` registrations marked idempotent at the same moment, as workers started together with
    ``--preload dask_gpupool`` make (distributed lets both start: neither finds a plugin listed): the one that runs
    second finds the first listed and does nothing, so each worker installs the worker plugin once, and the
    cluster runs the first one's pools."""
    plugins = [
        GPUPool(kind="host", max_size=size, broker_timeout="2s", broker_dir=str(tmp_path))
        for size in ("32MiB", "16MiB")
    ]
    for plugin in plugins:
        plugin.idempotent = True
    with nanny_cluster([{}, {}]) as c:
        c.run(T.hold_plugin_add, "none", "none", 0.0)  # holds nothing; counts the installs
        assert register_from_threads(c, plugins) == [None, None]
        size = registration_state(c)[0]["listed"]
        assert c.run(T.plugin_adds) == {w: [f"add {size}"] for w in worker_addresses(c)}
        c.run(T.release_plugin_add)
        assert_one_plugin(c, size, tmp_path)
        handoff_round_trip(c, MiB, b"installed once")
        assert rejected_on_scheduler(c) == {}
    assert os.listdir(tmp_path) == []


def register_in_background(c, plugin, then=None):
    """``c.register_plugin(plugin)`` on a thread of its own, started: returns the thread and the list its outcome
    lands in (``None``, or the exception raised; then ``then()``'s value, when given)."""
    import threading

    outcome = []

    def register():
        try:
            c.register_plugin(plugin)
            outcome.append(None)
        except BaseException as e:
            outcome.append(e)
        if then is not None:
            outcome.append(then())

    thread = threading.Thread(target=register)
    thread.start()
    return thread, outcome


def test_a_worker_killed_while_its_install_is_under_way_fails_the_registration_and_leaves_no_plugin_serving(
    tmp_path,
):
    """A worker dies while the scheduler waits for its answer to ``plugin-add`` (the broadcast's comm breaks):
    distributed's ``register_worker_plugin`` raises, and ``register_plugin`` with it. The registration's handlers
    stayed installed and its worker plugin registered, with the plugin never listed: the registry went on serving
    with no ``remove_worker`` reaching it, so a worker that died later kept its row for ever, and new workers kept
    installing pools of a plugin the scheduler did not have. A registration that fails so is now undone as one that a
    worker's setup failed: no handler serves (``pools`` says there is no registry), and no worker runs a pool. The
    caller gets a ``GPUPoolError`` naming the worker that left and its comm error (it got a ``CommClosedError`` naming
    its own connection to the scheduler, as if the scheduler were gone)."""
    plugin = GPUPool(kind="host", max_size="16MiB", broker_timeout="2s", broker_dir=str(tmp_path))
    with nanny_cluster([{}, {}]) as c:
        w0, _ = worker_addresses(c)
        pid = c.run(os.getpid, workers=[w0])[w0]
        c.run(T.hold_plugin_add, "16MiB", "none", 60.0, workers=[w0])
        thread, outcome = register_in_background(c, plugin)
        wait_for(lambda: c.run(T.plugin_adds, workers=[w0])[w0] == ["held 16MiB"])
        os.kill(pid, signal.SIGKILL)
        thread.join(120)
        # The caller is told which worker left: re-raised out of the scheduler's handler, the dead worker's
        # CommClosedError read as the caller's own connection closing (Dask aborted it unanswered).
        assert len(outcome) == 1 and isinstance(outcome[0], dask_gpupool.GPUPoolError), outcome
        assert w0 in str(outcome[0]) and "CommClosedError" in str(outcome[0]), outcome
        wait_for(lambda: len(worker_addresses(c)) == 2 and w0 not in worker_addresses(c), timeout=60)
        with pytest.raises(dask_gpupool.PoolUnavailableError):
            dask_gpupool.pools(c)
        assert c.run_on_scheduler(lambda dask_scheduler: "gpupool" in dask_scheduler.worker_plugins) is False
        assert c.run(lambda dask_worker: "gpupool" in dask_worker.plugins) == dict.fromkeys(worker_addresses(c), False)
    from dask_gpupool.transport.broker_dirs import remove_stale_broker_dirs

    remove_stale_broker_dirs(str(tmp_path), min_age=0)  # the killed worker never made one; w1's went with its pool
    assert os.listdir(tmp_path) == []


def assert_a_mib_goes_zero_copy(c, src, dst, payload):
    """A 1 MiB buffer made on ``src`` and read on ``dst`` arrives zero-copy: ``dst``'s counters gain 1 MiB received
    zero-copy and no copied byte."""
    from conftest import counters

    before = counters(c, dst)[dst]
    x = c.submit(T.make_buffer, MiB, payload, workers=[src], pure=False)
    assert c.submit(T.head, x, len(payload), workers=[dst], pure=False).result() == payload
    after = counters(c, dst)[dst]
    assert after["zero_copy_bytes"] - before["zero_copy_bytes"] == MiB, (before, after)
    assert after["copied_bytes"] == before["copied_bytes"], (before, after)


def test_a_registration_returns_while_a_worker_never_answers_its_install_and_that_worker_joins_when_it_resumes(
    tmp_path, caplog
):
    """A worker that never answers the scheduler's ``plugin-add`` (stopped with SIGSTOP, its event loop blocked)
    made ``register_plugin(GPUPool(...))`` wait for it, and every later registration wait behind that one, until
    ``distributed.scheduler.worker-ttl`` removed the worker (never, with ``worker-ttl: null``). A registration now
    returns within ``distributed.comm.timeouts.connect``, logging a WARNING that names the worker that did not
    answer; the workers that answered have pools and hand over zero-copy, and a later registration does not wait
    behind the stopped worker either. When it resumes, the worker ends with the pool of the plugin registered last
    (never the replaced one's), joins the registry and hands over zero-copy; nothing is refused or left behind."""
    import logging
    import threading

    import dask

    plugins = [
        GPUPool(kind="host", max_size=size, broker_timeout="2s", broker_dir=str(tmp_path))
        for size in ("32MiB", "16MiB")
    ]
    caplog.set_level(logging.WARNING, logger="dask_gpupool.dask.scheduler_plugin")
    with dask.config.set({"distributed.comm.timeouts.connect": "5s"}), nanny_cluster([{}, {}, {}]) as c:
        w0, w1, w2 = worker_addresses(c)
        pid = c.run(os.getpid, workers=[w2])[w2]
        os.kill(pid, signal.SIGSTOP)
        threads = []
        try:
            for plugin in plugins:
                outcome = []
                thread = threading.Thread(target=lambda p=plugin, o=outcome: o.append(c.register_plugin(p)))
                threads.append(thread)
                t0 = time.monotonic()
                thread.start()
                thread.join(30)
                assert outcome == [None], f"register_plugin had not returned after {time.monotonic() - t0:.0f} s"
                rows = by_worker(c)
                assert set(rows) == {w0, w1}
                assert {r.max_size for r in rows.values()} == {int(plugin.overrides["max_size"][:2]) * MiB}
                warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
                assert any(w2 in m and "did not answer" in m for m in warned), warned
                caplog.clear()
                assert_a_mib_goes_zero_copy(c, w0, w1, b"answered")
        finally:
            os.kill(pid, signal.SIGCONT)
            for thread in threads:
                thread.join(120)
        wait_for(lambda: set(by_worker(c)) == {w0, w1, w2}, timeout=60)
        assert_one_plugin(c, "16MiB", tmp_path)
        assert_a_mib_goes_zero_copy(c, w0, w2, b"resumed")
        assert rejected_on_scheduler(c) == {}
    assert os.listdir(tmp_path) == []


def test_a_stopped_worker_retired_while_a_registration_waits_for_it_leaves_the_registration_to_the_others(tmp_path):
    """A re-registration waits for a worker that never answers its install (stopped with SIGSTOP), and the operator
    retires that worker meanwhile (``client.retire_workers``): the scheduler removes it, and the listed plugin gives
    up the install it never answered (``remove_worker``). That worker left the cluster as any worker leaving during a
    registration does: ``register_plugin`` returns, the others run the new plugin's pools and hand over zero-copy,
    and the registry holds the live workers' rows only; nothing is refused or left behind."""

    import dask

    plugins = [
        GPUPool(kind="host", max_size=size, broker_timeout="2s", broker_dir=str(tmp_path))
        for size in ("32MiB", "16MiB")
    ]
    with dask.config.set({"distributed.comm.timeouts.connect": "30s"}), nanny_cluster([{}, {}], plugins[0]) as c:
        w0, w1 = worker_addresses(c)
        pid = c.run(os.getpid, workers=[w1])[w1]
        os.kill(pid, signal.SIGSTOP)
        thread, outcome = register_in_background(c, plugins[1])
        try:
            wait_for(lambda: set(by_worker(c)) == {w0} and {r.max_size for r in by_worker(c).values()} == {16 * MiB})
            c.retire_workers([w1], close_workers=False)
            thread.join(60)
            assert outcome == [None], outcome
        finally:
            os.kill(pid, signal.SIGKILL)
            thread.join(120)
        wait_for(lambda: w1 not in c.run_on_scheduler(lambda dask_scheduler: list(dask_scheduler.workers)))
        wait_for(lambda: len(worker_addresses(c)) == 2, timeout=60)  # the Nanny's new w1 joins
        wait_for(lambda: len(dask_gpupool.pools(c)) == 2, timeout=60)
        from dask_gpupool.transport.broker_dirs import remove_stale_broker_dirs

        remove_stale_broker_dirs(str(tmp_path), min_age=0)  # the killed w1's broker directory
        assert_one_plugin(c, "16MiB", tmp_path)
        handoff_round_trip(c, MiB, b"after a stopped worker was retired")
        assert rejected_on_scheduler(c) == {}
    assert os.listdir(tmp_path) == []


def test_a_registration_a_killed_worker_fails_raises_only_once_every_live_worker_answered_and_is_undone(tmp_path):
    """A worker dies while its install is under way, and another, live, answers its install a moment later (forced:
    w1 holds it for 3 s, far within ``distributed.comm.timeouts.connect``). ``register_plugin`` raised as soon as the
    dead worker's comm broke, before w1 answered: the undo skipped w1 (one message at a time), and w1 installed the
    failed registration's worker plugin after the caller was told it failed (the removal came later still; the
    neighbouring kill test saw w1 holding it, now and then, on a loaded machine). It now raises once every live
    worker answered and was undone: w1 installed it before, runs no pool after, and installs nothing later; no
    handler serves; nothing is left behind."""

    plugin = GPUPool(kind="host", max_size="16MiB", broker_timeout="2s", broker_dir=str(tmp_path))
    with nanny_cluster([{}, {}]) as c:
        w0, w1 = worker_addresses(c)
        pid = c.run(os.getpid, workers=[w0])[w0]
        c.run(T.hold_plugin_add, "16MiB", "none", 60.0, workers=[w0])
        c.run(T.hold_plugin_add, "16MiB", "none", 3.0, workers=[w1])
        # and what w1 had installed when it raised
        thread, outcome = register_in_background(c, plugin, then=lambda: c.run(T.plugin_adds, workers=[w1])[w1])
        wait_for(lambda: c.run(T.plugin_adds) == {w: ["held 16MiB"] for w in (w0, w1)})
        os.kill(pid, signal.SIGKILL)
        thread.join(120)
        assert len(outcome) == 2 and isinstance(outcome[0], Exception), outcome
        assert outcome[1] == ["held 16MiB", "add 16MiB"], outcome  # w1 had answered before it raised
        assert c.run(lambda dask_worker: "gpupool" in dask_worker.plugins, workers=[w1]) == {w1: False}
        with pytest.raises(dask_gpupool.PoolUnavailableError):
            dask_gpupool.pools(c)
        assert c.run_on_scheduler(lambda dask_scheduler: "gpupool" in dask_scheduler.worker_plugins) is False
        wait_for(lambda: len(worker_addresses(c)) == 2 and w0 not in worker_addresses(c), timeout=60)
        assert c.run(lambda dask_worker: "gpupool" in dask_worker.plugins) == dict.fromkeys(worker_addresses(c), False)
        assert c.run(T.plugin_adds, workers=[w1])[w1] == ["held 16MiB", "add 16MiB"]  # nothing installed since
    from dask_gpupool.transport.broker_dirs import remove_stale_broker_dirs

    remove_stale_broker_dirs(str(tmp_path), min_age=0)  # the killed worker never made one; w1's went with its pool
    assert os.listdir(tmp_path) == []


def gpupool_served(client):
    """What of the gpupool plugin the scheduler still serves (test inspection only): its RPC handlers, its stream
    handlers other than the one that drops late messages, and whether new workers get its worker plugin."""

    def on_scheduler(dask_scheduler):
        from dask_gpupool.core import JOINED_OP, PLUGIN_NAME, REGISTER_OP, UNREGISTER_OP, UPDATE_OP
        from dask_gpupool.dask.scheduler_plugin import _drop
        from dask_gpupool.ops.dashboard import STATS_OP

        ops = (REGISTER_OP, JOINED_OP, UPDATE_OP, UNREGISTER_OP, STATS_OP)
        return {
            "handlers": sorted(op for op in dask_scheduler.handlers if op.startswith("gpupool")),
            "stream-handlers": sorted(op for op in ops if dask_scheduler.stream_handlers.get(op) not in (None, _drop)),
            "worker-plugin": PLUGIN_NAME in dask_scheduler.worker_plugins,
        }

    return client.run_on_scheduler(on_scheduler)


def test_unregistering_the_scheduler_plugin_stops_its_handlers_and_every_pool_and_a_new_registration_works(tmp_path):
    """``client.unregister_scheduler_plugin("gpupool")``: distributed only delists the plugin (``remove_plugin`` calls
    no ``close``), so its handlers kept serving the registry, new workers kept getting its worker plugin, and every
    worker's pool kept running. Now no gpupool handler serves (late stream messages are dropped), the worker plugin is
    unregistered from every worker (their pools close, their broker directories go), and a later registration works
    from a clean state; nothing is refused or left behind."""
    plugin = GPUPool(kind="host", max_size="16MiB", broker_timeout="2s", broker_dir=str(tmp_path))
    with nanny_cluster([{}, {}], plugin) as c:
        assert len(broker_dirs(tmp_path)) == 2
        c.unregister_scheduler_plugin("gpupool")
        gone = {"handlers": [], "stream-handlers": [], "worker-plugin": False}
        wait_for(lambda: gpupool_served(c) == gone, timeout=30)
        with pytest.raises(dask_gpupool.PoolUnavailableError):
            dask_gpupool.pools(c)
        no_plugin = dict.fromkeys(worker_addresses(c), False)
        wait_for(lambda: c.run(lambda dask_worker: "gpupool" in dask_worker.plugins) == no_plugin, timeout=30)
        wait_for(lambda: broker_dirs(tmp_path) == [], timeout=30)
        c.register_plugin(GPUPool(kind="host", max_size="32MiB", broker_timeout="2s", broker_dir=str(tmp_path)))
        assert_one_plugin(c, "32MiB", tmp_path)
        handoff_round_trip(c, MiB, b"registered after it was unregistered")
        assert rejected_on_scheduler(c) == {}
    assert os.listdir(tmp_path) == []


def watch_looks(client, name):
    """How often the watch of the ``GPUPool`` listed as ``name`` looked whether distributed still lists it, counted
    from this helper's first call, which starts counting (test inspection only)."""

    def on_scheduler(dask_scheduler):
        plugin = dask_scheduler.plugins[name]
        if "_looks" not in vars(plugin):
            plugin._looks = 0
            look = plugin._check_listed

            def counted(scheduler):
                plugin._looks += 1
                look(scheduler)

            plugin._check_listed = counted  # the watch calls it by name each time
        return plugin._looks

    return client.run_on_scheduler(on_scheduler)


def test_a_plugin_registered_under_a_name_of_its_own_serves_until_unregistered_under_that_name(tmp_path):
    """``client.register_plugin(GPUPool(...), name="pools")``: distributed lists the plugin under the name given. Its
    watch looked for it under ``"gpupool"`` only, took it for unregistered half a second after it started and tore
    it down (its handlers, every worker's pool). It now serves on, pools hand over zero-copy, and
    ``client.unregister_scheduler_plugin("pools")`` tears it down as unregistering ``"gpupool"`` does; nothing is
    refused or left behind."""
    plugin = GPUPool(kind="host", max_size="16MiB", broker_timeout="2s", broker_dir=str(tmp_path))
    with nanny_cluster([{}, {}]) as c:
        c.register_plugin(plugin, name="pools")
        watch_looks(c, "pools")
        # a watch that takes the plugin for unregistered stops looking (and tears it down)
        wait_for(lambda: watch_looks(c, "pools") >= 4, timeout=30, what="the watch to look four times")
        served = {
            "handlers": sorted(gpupool_served(c)["handlers"]),
            "worker-plugin": gpupool_served(c)["worker-plugin"],
        }
        assert served == {
            "handlers": ["gpupool_pools", "gpupool_register", "gpupool_registration", "gpupool_unregister"],
            "worker-plugin": True,
        }
        assert set(by_worker(c)) == set(worker_addresses(c))
        assert len(broker_dirs(tmp_path)) == 2
        handoff_round_trip(c, MiB, b"registered under a name of its own")
        assert c.run_on_scheduler(lambda dask_scheduler: dict(dask_scheduler.plugins["pools"].rejected)) == {}
        c.unregister_scheduler_plugin("pools")
        gone = {"handlers": [], "stream-handlers": [], "worker-plugin": False}
        wait_for(lambda: gpupool_served(c) == gone, timeout=30)
        no_plugin = dict.fromkeys(worker_addresses(c), False)
        wait_for(lambda: c.run(lambda dask_worker: "gpupool" in dask_worker.plugins) == no_plugin, timeout=30)
        wait_for(lambda: broker_dirs(tmp_path) == [], timeout=30)
    assert os.listdir(tmp_path) == []


def test_a_registration_under_another_name_delists_the_plugin_it_replaces_and_unregistering_it_tears_all_down(
    tmp_path,
):
    """``register_plugin(GPUPool(...))`` (listed as ``"gpupool"``), then ``register_plugin(GPUPool(...),
    name="pools")``: the second replaced the first's handlers and worker plugins, yet distributed listed both, so
    unregistering ``"pools"`` left the first listed and taken for a registration made since: no watch tore anything
    down, and the second's handlers and every worker's pool served on. The later registration now delists the one it
    replaced: the scheduler lists one ``GPUPool``, under ``"pools"``; every worker runs its pool and hands over
    zero-copy; unregistering ``"pools"`` leaves no handler serving, no worker plugin, no pool, no ``GPUPool``
    listed; nothing is refused or left behind."""
    plugins = [
        GPUPool(kind="host", max_size=size, broker_timeout="2s", broker_dir=str(tmp_path))
        for size in ("32MiB", "16MiB")
    ]
    with nanny_cluster([{}, {}], plugins[0]) as c:
        w0, w1 = worker_addresses(c)
        c.register_plugin(plugins[1], name="pools")
        assert listed_gpupools(c) == {"pools": "16MiB"}
        assert_one_plugin(c, "16MiB", tmp_path, name="pools")
        assert_a_mib_goes_zero_copy(c, w0, w1, b"under a name of its own")
        assert_a_mib_goes_zero_copy(c, w1, w0, b"and back")
        assert rejected_on_scheduler(c, "pools") == {}
        c.unregister_scheduler_plugin("pools")
        gone = {"handlers": [], "stream-handlers": [], "worker-plugin": False}
        wait_for(lambda: gpupool_served(c) == gone, timeout=30)
        assert listed_gpupools(c) == {}
        with pytest.raises(dask_gpupool.PoolUnavailableError):
            dask_gpupool.pools(c)
        no_plugin = dict.fromkeys(worker_addresses(c), False)
        wait_for(lambda: c.run(lambda dask_worker: "gpupool" in dask_worker.plugins) == no_plugin, timeout=30)
        wait_for(lambda: broker_dirs(tmp_path) == [], timeout=30)
    assert os.listdir(tmp_path) == []


def test_an_idempotent_registration_finding_a_plugin_listed_under_another_name_does_nothing(tmp_path):
    """A ``GPUPool`` listed as ``"pools"``, then an idempotent registration (what ``--preload dask_gpupool`` makes,
    under ``"gpupool"``): distributed found no plugin under ``"gpupool"``, and the plugin looked under that name only,
    so it replaced the running one everywhere and both were listed. It now does nothing: one ``GPUPool`` listed, as
    ``"pools"``; no worker installs a plugin; every worker keeps its pool; nothing is refused or left behind."""
    plugin = GPUPool(kind="host", max_size="16MiB", broker_timeout="2s", broker_dir=str(tmp_path))
    preloaded = GPUPool(kind="host", max_size="32MiB", broker_timeout="2s", broker_dir=str(tmp_path))
    preloaded.idempotent = True
    with nanny_cluster([{}, {}]) as c:
        w0, w1 = worker_addresses(c)
        c.register_plugin(plugin, name="pools")
        before = by_worker(c)
        c.run(T.hold_plugin_add, "none", "none", 0.0)  # holds nothing; counts the installs
        c.register_plugin(preloaded)  # returns once its start did: any install it made was answered by then
        assert c.run(T.plugin_adds) == {w0: [], w1: []}
        c.run(T.release_plugin_add)
        assert listed_gpupools(c) == {"pools": "16MiB"}
        assert by_worker(c) == before
        assert_one_plugin(c, "16MiB", tmp_path, name="pools")
        assert_a_mib_goes_zero_copy(c, w0, w1, b"preloaded once")
        assert rejected_on_scheduler(c, "pools") == {}
    assert os.listdir(tmp_path) == []
