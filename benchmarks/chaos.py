"""Chaos: a zero-copy workload while random workers are stopped and killed.

Real ``Nanny`` workers (``device`` pools when GPUs are visible, ``host`` pools
otherwise). For ``--seconds``, rounds run back to back: in each, ``--pairs``
producer/consumer pairs (random, distinct workers) hand over a value of
``--nbytes`` filled with a value of the round: a pool buffer, a plain array
staged into the producer's pool, or a pool buffer forwarded by a third worker
that imported it (``--values``, one picked at random per pair); the
producer's key (and the middle worker's import) is then dropped and those
workers scribble over every byte of their pools they can get
(``--scribbles`` buffers); the consumer checks that every byte it holds is
still the round's value. Meanwhile a chaos thread picks a random worker every
``--every`` seconds (on average) and either SIGKILLs it (``--kill-share`` of
the picks; its Nanny restarts it) or SIGSTOPs it for up to twice the larger of
``lease-timeout`` and ``broker-timeout``, then SIGCONTs it.

Reported:

- rounds and handoffs checked (also by kind of value);
- **wrong bytes**: checks that read anything but the round's value (must be 0);
- **CUDA errors**: task errors whose text names a CUDA error (must be 0);
- **hung rounds**: rounds not finished within ``--round-timeout`` (must be 0);
- task errors by type (a consumer killed mid-task is retried by Dask; errors
  that still reach the client are listed);
- per worker name, fds, sockets, leases, held imports and pool bytes after a
  warm-up at the start and after a quiet period at the end.

Writes JSON to ``chaos-*.json`` in ``$BENCH_RESULTS`` (default ``benchmarks/results/``) and ``$OUT``.

    python benchmarks/chaos.py [--seconds 600] [--workers 4] [--gpus -1] [--values pool,plain,forwarded]
                               [--protocol tcp|ucxx]
        [--segment-memory legacy]
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import signal
import sys
import threading
import time
from typing import Any

import dask
from dask.utils import parse_bytes

import dask_gpupool
from dask_gpupool import GPUPool
from dask_gpupool import testing as T
from dask_gpupool.memory.topology import local_devices

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
sys.path.insert(0, os.path.dirname(__file__))
import handoff as H

MiB = 1 << 20


def worker_specs(n: int, gpus: int) -> list[dict[str, Any]]:
    """``n`` workers: on ``gpus`` GPUs round-robin in dask-cuda's rotated layout, else plain."""
    if not gpus:
        return [{} for _ in range(n)]
    specs = []
    for i in range(n):
        g = i % gpus
        order = [str((g + k) % gpus) for k in range(gpus)]
        specs.append({"env": {"CUDA_VISIBLE_DEVICES": ",".join(order)}})
    return specs


def pids(client: Any) -> dict[str, int]:
    return client.run(os.getpid)


def names(client: Any) -> dict[str, str]:
    """worker address -> name (stable across a Nanny's restarts)."""
    return {addr: str(w["name"]) for addr, w in client.scheduler_info(n_workers=-1)["workers"].items()}


def port_roles(client: Any) -> dict[int, str]:
    """TCP port -> role in the cluster (``worker:<name>``, ``nanny:<name>``, ``scheduler``), for socket_peers."""
    from urllib.parse import urlsplit

    info = client.scheduler_info(n_workers=-1)
    roles = {urlsplit(info["address"]).port or 0: "scheduler"}
    for addr, w in info["workers"].items():
        roles[urlsplit(addr).port or 0] = f"worker:{w['name']}"
        if w.get("nanny"):
            roles[urlsplit(w["nanny"]).port or 0] = f"nanny:{w['name']}"
    return roles


def snapshot(client: Any) -> dict[str, dict[str, Any]]:
    by_addr = client.run(T.resources)
    counts = client.run(T.lease_counts)
    peers = client.run(T.socket_peers, port_roles(client))
    nm = names(client)
    out = {}
    for addr, res in by_addr.items():
        out[nm.get(addr, addr)] = {
            "fds": res["fds"],
            "sockets": res["sockets"],
            "leases": res["leases"],
            "imports_held": res["imports_held"],
            "pool_used": res["used"],
            "mapped_pools": res["mapped_pools"],
            "broker_connections": res["broker_connections"],
            "fd_kinds": res["fd_kinds"],
            "socket_peers": peers.get(addr, []),
            "unclaimed": counts[addr]["unclaimed"],
        }
    return out


class Chaos(threading.Thread):
    """Stops and kills random worker processes until :meth:`stop`."""

    def __init__(self, client: Any, every: float, kill_share: float, max_stop: float, seed: int) -> None:
        super().__init__(name="chaos", daemon=True)
        self.client = client
        self.every, self.kill_share, self.max_stop = every, kill_share, max_stop
        self.rng = random.Random(seed)
        self.kills = self.stops = 0
        self.stopped_seconds = 0.0
        self.events: list[tuple[float, str, str, float]] = []
        self._done = threading.Event()

    def run(self) -> None:
        t0 = time.monotonic()
        while not self._done.wait(self.rng.expovariate(1 / self.every)):
            try:
                workers = pids(self.client)
            except Exception:
                continue
            if not workers:
                continue
            addr = self.rng.choice(sorted(workers))
            pid = workers[addr]
            try:
                if self.rng.random() < self.kill_share:
                    os.kill(pid, signal.SIGKILL)
                    self.kills += 1
                    self.events.append((time.monotonic() - t0, "kill", addr, 0.0))
                else:
                    pause = self.rng.uniform(0.1, self.max_stop)
                    os.kill(pid, signal.SIGSTOP)
                    try:
                        self._done.wait(pause)
                    finally:
                        os.kill(pid, signal.SIGCONT)
                    self.stops += 1
                    self.stopped_seconds += pause
                    self.events.append((time.monotonic() - t0, "stop", addr, round(pause, 2)))
            except ProcessLookupError:
                pass

    def stop(self) -> None:
        self._done.set()
        self.join(60)


#: What a round's pairs hand over (``--values``): ``pool`` a pool buffer (``T.fill``), handed over; ``plain`` an
#: array from the library's own allocator (``T.plain_fill``: NumPy on ``host`` pools, CuPy's pool on ``device``
#: ones), staged into the producer's pool and handed over; ``forwarded`` a pool buffer passed on by a worker that
#: imported it (A -> B -> C: C maps A's memory, and B lets go of its import before the check).
VALUES = ("pool", "plain", "forwarded")


async def stage_from(nbytes: int, dask_worker: Any) -> None:
    """client.run target: this worker's routing stages plain arrays from ``nbytes`` (``host`` pools from 1 MiB by
    default, ``dask_gpupool.tuning.HOST_STAGE_THRESHOLD``; :func:`dask_gpupool.testing.faults.route_sizes`). A
    worker without its pool yet (restarting) is left alone: the next round gives it the size. A coroutine, so that
    ``client.run`` need not wait for it (``wait=False``): a stopped worker answers only once it runs again."""
    try:
        T.route_sizes(dask_worker, stage=nbytes)
    except dask_gpupool.PoolUnavailableError:
        pass


def one_round(client: Any, rnd: int, args: argparse.Namespace, rng: random.Random) -> dict[str, Any]:
    client.wait_for_workers(2, timeout=300)  # killed workers are restarting
    workers = sorted(client.scheduler_info(n_workers=-1)["workers"])
    while len(workers) < 2:
        time.sleep(0.5)
        workers = sorted(client.scheduler_info(n_workers=-1)["workers"])
    if args.stage_threshold:  # each round: a restarted worker has the defaults again; a stopped one answers later
        client.run(stage_from, int(parse_bytes(args.stage_threshold)), wait=False)
    kinds = [v for v in args.values.split(",") if v]

    def on(w: str) -> dict[str, Any]:
        return {"workers": [w], "pure": False, "allow_other_workers": True}

    # per pair: (what, producer, the middle worker of a forward or None, consumer, value)
    pairs = []
    for i in range(args.pairs):
        what = rng.choice(kinds)
        if what == "forwarded" and len(workers) < 3:
            what = "pool"
        if what == "forwarded":
            p, b, c = rng.sample(workers, 3)
        else:
            (p, c), b = rng.sample(workers, 2), None
        pairs.append((what, p, b, c, (rnd * args.pairs + i) % 250 + 1))
    made, middles, ys = [], [], []
    for what, p, b, c, v in pairs:
        x = client.submit(T.plain_fill if what == "plain" else T.fill, args.nbytes, v, **on(p))
        if b is not None:
            m = client.submit(T.keep, x, **on(b))  # b imports p's memory, then passes it on to c
            middles.append(m)
            x_for_c = m
        else:
            x_for_c = x
        made.append(x)
        ys.append(client.submit(T.keep, x_for_c, **on(c)))

    def check(y: Any, what: str, c: str, v: int) -> Any:
        return client.submit(T.array_equal if what == "plain" else T.all_equal, y, v, **on(c))

    first = [check(y, what, c, v) for y, (what, _, _, c, v) in zip(ys, pairs, strict=True)]
    out: dict[str, Any] = {
        "checks": 0,
        "wrong": 0,
        "errors": collections.Counter(),
        "hung": False,
        "checks_by": collections.Counter(),
        "wrong_by": collections.Counter(),
    }

    def gather(futs: list[Any]) -> list[Any]:
        from distributed import wait

        deadline = time.monotonic() + args.round_timeout
        while True:
            pending = [f for f in futs if f.status == "pending"]
            if not pending or time.monotonic() > deadline:
                break
            try:
                wait(pending, timeout=max(0.1, deadline - time.monotonic()))
            except Exception:  # a timeout, or a cancelled future: each is reported below
                pass
        if pending:
            out["hung"] = True
        results = []
        for f in futs:
            if f.status == "pending":
                results.append(None)
                continue
            try:
                results.append(f.result())
            except Exception as e:
                out["errors"][type(e).__name__ + (": CUDA" if "CUDA" in str(e) else "")] += 1
                results.append(None)
        return results

    def count(oks: list[Any]) -> None:
        for ok, (what, *_rest) in zip(oks, pairs, strict=True):
            if ok is not None:
                out["checks"] += 1
                out["wrong"] += int(not ok)
                out["checks_by"][what] += 1
                out["wrong_by"][what] += int(not ok)

    count(gather(first))
    for f in made + middles:  # the producers' keys, and the middle workers' imports
        f.release()
    scribblers = [p for _, p, _, _, _ in pairs] + [b for _, _, b, _, _ in pairs if b is not None]
    scribbles = [
        client.submit(T.scribble_all, args.nbytes, 0, **on(w)) for w in scribblers for _ in range(args.scribbles)
    ]
    second = [check(y, what, c, v) for y, (what, _, _, c, v) in zip(ys, pairs, strict=True)]
    count(gather(second))
    gather(scribbles)
    del made, middles, ys, first, second, scribbles
    return out


def warm_all(client: Any, nbytes: int) -> None:
    """One handoff for every ordered pair of workers: every link and mapping the workload can open is open."""
    workers = sorted(client.scheduler_info(n_workers=-1)["workers"])
    checks = []
    for p in workers:
        for c in workers:
            if p != c:
                x = client.submit(T.fill, nbytes, 7, workers=[p], pure=False)
                checks.append(client.submit(T.all_equal, x, 7, workers=[c], pure=False))
    assert all(client.gather(checks))
    del checks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=600)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--gpus", type=int, default=-1, help="GPUs to spread workers over (-1: all visible)")
    parser.add_argument("--pairs", type=int, default=4)
    parser.add_argument("--nbytes", type=int, default=8 * MiB)
    parser.add_argument("--scribbles", type=int, default=2)
    parser.add_argument("--every", type=float, default=3.0, help="mean seconds between chaos events")
    parser.add_argument("--kill-share", type=float, default=0.25)
    parser.add_argument("--lease-timeout", type=float, default=2.0)
    parser.add_argument("--broker-timeout", type=float, default=2.0)
    parser.add_argument("--round-timeout", type=float, default=180.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--values", default=",".join(VALUES), help="what the pairs hand over: " + ", ".join(VALUES))
    parser.add_argument(
        "--stage-threshold",
        default="1 MiB",
        help="the stage threshold given to every worker's routing each round ('': the defaults, 1 MiB on host pools)",
    )
    parser.add_argument(
        "--segment-memory",
        default="",
        help="gpupool.segment-memory of device pools ('': auto, VMM over TCP and legacy over UCX; vmm; legacy)",
    )
    parser.add_argument(
        "--protocol",
        default="tcp",
        choices=["tcp", "ucxx"],
        help="the workers' comm: ucxx (distributed-ucxx) hands pool memory over in UCX messages, on legacy IPC "
        "segments at the default segment memory",
    )
    args = parser.parse_args()
    unknown = set(args.values.split(",")) - set(VALUES) - {""}
    if unknown:
        parser.error(f"unknown --values {sorted(unknown)}; known: {', '.join(VALUES)}")

    from conftest import nanny_cluster

    visible = len(local_devices().uuids)
    gpus = visible if args.gpus < 0 else min(args.gpus, visible)
    kind = "device" if gpus else "host"
    plugin = GPUPool(
        kind=kind,
        max_size="2 GiB" if gpus else "512 MiB",
        lease_timeout=args.lease_timeout,
        broker_timeout=args.broker_timeout,
        segment_memory=(args.segment_memory or None) if gpus else None,
    )
    max_stop = 2 * max(args.lease_timeout, args.broker_timeout)
    config = {
        "distributed.scheduler.allowed-failures": 1000,
        # SpecCluster closes a Nanny for good when its worker's name is still missing from the scheduler this
        # long after the worker left (15 s by default); with kills every few seconds a worker can be down again at
        # that moment: a run on two H200s (2026-11-23) lost three of its four Nannies that way.
        "distributed.deploy.lost-worker-timeout": "1h",
    }
    rng = random.Random(args.seed)
    result: dict[str, Any] = {"args": vars(args), "kind": kind, "gpus": gpus, "devices": local_devices().uuids}
    specs = worker_specs(args.workers, gpus)
    cluster_options: dict[str, Any] = {}
    if args.protocol == "ucxx":
        ucx = ("create-cuda-context", "nvlink", "tcp", "cuda-copy")
        config.update({f"distributed.comm.ucx.{k}": True for k in ucx})
        specs = [{**spec, "protocol": "ucxx"} for spec in specs]
        cluster_options["protocol"] = "ucxx"
    with dask.config.set(config), nanny_cluster(specs, plugin, **cluster_options) as client:
        warm_all(client, args.nbytes)
        time.sleep(1)
        result["start"] = snapshot(client)
        chaos = Chaos(client, args.every, args.kill_share, max_stop, args.seed)
        totals: dict[str, Any] = {
            "rounds": 0,
            "checks": 0,
            "wrong": 0,
            "hung": 0,
            "errors": collections.Counter(),
            "checks_by": collections.Counter(),
            "wrong_by": collections.Counter(),
        }
        t0 = time.monotonic()
        chaos.start()
        try:
            rnd = 1
            while time.monotonic() - t0 < args.seconds:
                r = one_round(client, rnd, args, rng)
                totals["rounds"] += 1
                totals["checks"] += r["checks"]
                totals["wrong"] += r["wrong"]
                totals["hung"] += int(r["hung"])
                totals["errors"].update(r["errors"])
                totals["checks_by"].update(r["checks_by"])
                totals["wrong_by"].update(r["wrong_by"])
                rnd += 1
                if rnd % 20 == 0:
                    print(
                        f"t={time.monotonic() - t0:6.0f}s rounds={totals['rounds']} checks={totals['checks']} "
                        f"wrong={totals['wrong']} hung={totals['hung']} kills={chaos.kills} stops={chaos.stops} "
                        f"errors={dict(totals['errors'])} by={dict(totals['checks_by'])}",
                        flush=True,
                    )
        finally:
            chaos.stop()
        elapsed = time.monotonic() - t0
        try:
            client.wait_for_workers(args.workers, timeout=30)
        except Exception as e:  # SpecCluster sometimes closes a Nanny whose worker was killed as it started
            print(f"not every worker came back: {e}; comparing the ones that did", flush=True)
        result["workers_at_end"] = sorted(names(client).values())
        # quiet period: every pair once more without chaos, then everything released
        warm_all(client, args.nbytes)
        deadline = time.monotonic() + 120
        end = snapshot(client)
        while time.monotonic() < deadline and any(v["leases"] or v["pool_used"] for v in end.values()):
            time.sleep(1)
            end = snapshot(client)
        result["end"] = end
        # what the workers' handoffs were, summed over the workers now up (a restarted worker's counters start anew)
        counters: dict[str, Any] = {"fallbacks": collections.Counter()}
        for s in dask_gpupool.stats(client).values():
            for k in ("exports", "imports", "forwards", "pool_staged_bytes", "copied_out_bytes"):
                counters[k] = counters.get(k, 0) + s.get(k, 0)
            counters["fallbacks"].update(s.get("fallbacks", {}))
        result["handoffs"] = counters
        cuda_errors = sum(n for k, n in totals["errors"].items() if k.endswith(": CUDA"))
        result.update(
            seconds=round(elapsed, 1),
            rounds=totals["rounds"],
            checks=totals["checks"],
            wrong=totals["wrong"],
            hung=totals["hung"],
            cuda_errors=cuda_errors,
            errors=dict(totals["errors"]),
            checks_by=dict(totals["checks_by"]),
            wrong_by=dict(totals["wrong_by"]),
            kills=chaos.kills,
            stops=chaos.stops,
            stopped_seconds=round(chaos.stopped_seconds, 1),
            events=chaos.events,
        )
    H.save_json("chaos", result)
    print(f"\nchaos: {kind} pools, {args.workers} workers on {gpus or 'no'} GPU(s), {result['seconds']} s")
    print(
        f"rounds {result['rounds']}, handoffs checked {result['checks']}, kills {result['kills']}, "
        f"stops {result['stops']} ({result['stopped_seconds']} s stopped, each up to {max_stop:.0f} s)"
    )
    print(f"wrong bytes: {result['wrong']}   CUDA errors: {result['cuda_errors']}   hung rounds: {result['hung']}")
    by = ", ".join(f"{k} {n} ({result['wrong_by'].get(k, 0)} wrong)" for k, n in sorted(result["checks_by"].items()))
    print(f"checked by value: {by or 'none'}")
    print(f"handoffs of the workers up at the end: {result['handoffs']}")
    print(f"task errors reaching the client: {result['errors'] or 'none'}")
    print(f"{'worker':8} {'':5} {'fds':>5} {'sockets':>7} {'leases':>6} {'held':>5} {'pool bytes':>11}")
    for name in sorted(result["end"]):
        for when in ("start", "end"):
            v = result[when].get(name, {})
            print(
                f"{name:8} {when:5} {v.get('fds', '-'):>5} {v.get('sockets', '-'):>7} {v.get('leases', '-'):>6} "
                f"{v.get('imports_held', '-'):>5} {v.get('pool_used', '-'):>11}"
            )
    # which sockets differ, by what they connect (ports named by role: worker:<name>, nanny:<name>, scheduler)
    for name in sorted(result["end"]):
        start = collections.Counter(result["start"].get(name, {}).get("socket_peers", []))
        end = collections.Counter(result["end"][name].get("socket_peers", []))
        more, fewer = end - start, start - end
        if more or fewer:
            print(f"{name}: sockets more at the end {dict(more)}; fewer {dict(fewer)}")


if __name__ == "__main__":
    main()
