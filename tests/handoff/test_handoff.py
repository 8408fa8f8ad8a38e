"""Zero-copy handoff between real Nanny workers with ``host`` pools (runs in CI, no GPU)."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import pytest
from conftest import (
    HOST_POOL,
    back_to,
    counters,
    kind_cluster,
    nanny_cluster,
    pid_of,
    pool_kinds,
    stress,
    wait_for,
    warm_up,
    worker_addresses,
)

import dask_gpupool
from dask_gpupool import GPUPool
from dask_gpupool import testing as T

MiB = 1 << 20
GiB = 1 << 30


def test_same_host_handoff_maps_the_producers_memory():
    with nanny_cluster([{}, {}], HOST_POOL) as c:
        a, b = worker_addresses(c)
        baseline = warm_up(c, a, b)
        before = counters(c)

        x = c.submit(T.make_buffer, MiB, b"written by A", workers=[a], pure=False)
        y = c.submit(T.keep, x, workers=[b], pure=False)
        assert c.submit(T.describe, y, workers=[b], pure=False).result()["imported"]
        assert c.submit(T.head, y, 12, workers=[b], pure=False).result() == b"written by A"

        # A byte A writes afterwards is visible to B: B reads A's memory, not a copy.
        c.submit(T.overwrite, x, b"WRITTEN BY A", workers=[a], pure=False).result()
        assert c.submit(T.head, y, 12, workers=[b], pure=False).result() == b"WRITTEN BY A"

        now = counters(c)
        assert now[b]["copied_bytes"] == before[b]["copied_bytes"]
        assert now[b]["zero_copy_bytes"] - before[b]["zero_copy_bytes"] == MiB
        assert now[a]["exports"] - before[a]["exports"] == 1
        assert now[a]["leases"] == 1 and now[a]["lease_bytes"] == MiB
        assert now[b]["fallbacks"] == {} and now[a]["fallbacks"] == {}

        # After B drops the result, A's lease count and pool bytes return to their baseline.
        del y
        c.submit(T.keep, 0, workers=[b], pure=False).result()
        del x
        back_to(c, baseline)


def test_arrays_over_pool_buffers_hand_over_and_plain_arrays_do_not():
    import numpy as np

    with nanny_cluster([{}, {}], HOST_POOL) as c:
        a, b = worker_addresses(c)
        baseline = warm_up(c, a, b)
        arr = c.submit(T.make_array, 10_000, workers=[a], pure=False)  # 80 KB: from 64 KiB host pools hand over
        info = c.submit(T.describe, c.submit(T.keep, arr, workers=[b], pure=False), workers=[b], pure=False)
        assert info.result() == {"type": "numpy.ndarray", "imported": True, "in_own_pool": False}
        assert c.submit(T.total, arr, workers=[b], pure=False).result() == float(np.arange(10_000).sum())
        plain = c.submit(np.arange, 10, workers=[a], pure=False)
        assert c.submit(T.total, plain, workers=[b], pure=False).result() == 45.0
        # A client gets a host copy.
        np.testing.assert_array_equal(arr.result(), np.arange(10_000, dtype="f8"))
        del arr, info, plain
        back_to(c, baseline)


def test_a_plain_array_to_a_same_host_peer_is_counted_as_a_copy_with_its_reason():
    """Every same-host transfer that is not zero-copy appears in stats() with its reason."""
    import numpy as np

    hosts = [{}, {}, {"config": {"gpupool": {"host-id": "elsewhere"}}}]
    with nanny_cluster(hosts, HOST_POOL) as c:
        a, b, far = worker_addresses(c)
        before = counters(c)
        near = c.submit(np.arange, 1000, workers=[a], pure=False)  # NumPy's memory, not the pool's
        away = c.submit(np.arange, 1000, workers=[a], pure=False)
        assert c.submit(T.total, near, workers=[b], pure=False).result() == float(np.arange(1000).sum())
        assert c.submit(T.total, away, workers=[far], pure=False).result() == float(np.arange(1000).sum())
        now = counters(c)
        assert now[a]["fallbacks"] == {"small": 1}  # to B; the other host's copy is expected, not a fallback
        assert now[a]["copied_out_bytes"] - before[a]["copied_out_bytes"] == 2 * 8000
        assert now[b]["fallbacks"] == {} and now[far]["fallbacks"] == {}


def _records_in_pool(n: int) -> Any:
    """Task: ``n`` records of a structured dtype in the pool (an array header cannot describe it: a copy)."""
    import numpy as np

    a = np.zeros(n, [("i", "<i4"), ("x", "<f8")])
    a["i"] = np.arange(n)
    return dask_gpupool.to_pool(a)


def _pickled_arrays(n: int) -> Any:
    """Task: a plain array of ``n`` float64 inside an object Dask pickles (the array goes as a pickle frame)."""
    import types

    import numpy as np

    return types.SimpleNamespace(arr=np.arange(n, dtype="f8"))


def _first(x: Any) -> float:
    return float(x.arr[1] if hasattr(x, "arr") else x[1]["i"] if x.dtype.names else x[1])


def test_every_same_host_copy_is_counted_by_the_consumer_as_by_the_producer():
    """A value that goes to a same-host worker in Dask's frames (a plain NumPy array, a pool array of a structured
    dtype, an array inside an object Dask pickles) is counted on both sides: the producer's ``copied_out_bytes``
    and the consumer's ``copied_bytes`` grow by its bytes. Back to the baseline after."""
    import numpy as np

    with nanny_cluster([{}, {}], HOST_POOL) as c:
        a, b = worker_addresses(c)
        baseline = warm_up(c, a, b)
        for make, nbytes in ((np.arange, 8 * 1000), (_records_in_pool, 12 * 1000), (_pickled_arrays, 8 * 1000)):
            before = counters(c)
            x = c.submit(make, 1000, workers=[a], pure=False)
            assert c.submit(_first, x, workers=[b], pure=False).result() == 1.0
            now = counters(c)
            sent = now[a]["copied_out_bytes"] - before[a]["copied_out_bytes"]
            received = now[b]["copied_bytes"] - before[b]["copied_bytes"]
            assert (sent, received) == (nbytes, nbytes), make.__name__
            del x
        back_to(c, baseline)


def test_a_large_plain_array_is_staged_into_the_pool_and_handed_over():
    """From the stage threshold up (given here: host pools stage from 1 MiB by default, device pools from 64 KiB), an
    array outside the pool is copied into it on the producer and handed over to a same-host worker: no comm bytes,
    counted as fallback staged-in-pool; back to baseline after."""
    import numpy as np

    hosts = [{}, {}, {"config": {"gpupool": {"host-id": "elsewhere"}}}]
    with nanny_cluster(hosts, HOST_POOL) as c:
        a, b, far = worker_addresses(c)
        c.run(T.route_sizes, stage=4 * MiB, workers=[a])
        warm_up(c, a, far)  # Dask's comms between them stay open: part of the baseline
        baseline = warm_up(c, a, b)
        before = counters(c)
        n = 1 << 20  # 8 MiB of float64
        near = c.submit(np.arange, n, dtype="f8", workers=[a], pure=False)
        away = c.submit(np.arange, n, dtype="f8", workers=[a], pure=False)
        got = c.submit(T.keep, near, workers=[b], pure=False)
        assert c.submit(T.total, got, workers=[b], pure=False).result() == float(np.arange(n).sum())
        assert c.submit(T.describe, got, workers=[b], pure=False).result()["imported"]
        assert c.submit(T.try_write, got, workers=[b], pure=False).result() == "ValueError"  # shared, read-only
        assert c.submit(T.total, away, workers=[far], pure=False).result() == float(np.arange(n).sum())
        small = c.submit(np.arange, 1000, dtype="f8", workers=[a], pure=False)  # below the threshold: the comm
        assert c.submit(T.total, small, workers=[b], pure=False).result() == float(np.arange(1000).sum())
        now = counters(c)
        # the other host's copy is expected: no fallback; the small array is counted as such
        assert now[a]["fallbacks"] == {"staged-in-pool": 1, "small": 1}
        assert now[a]["pool_staged_bytes"] - before[a]["pool_staged_bytes"] == 8 * n
        assert now[b]["zero_copy_bytes"] - before[b]["zero_copy_bytes"] == 8 * n
        assert now[b]["copied_bytes"] - before[b]["copied_bytes"] == 8 * 1000  # the small one
        assert now[a]["leases"] == 1  # the staged copy lives while B holds it
        # where the time went: each step timed once more (warm_up's own handoffs are in "before"); no claim round
        # trip (the lease is claimed by the reply)
        steps = {"producer": (a, ("stage", "export", "reply")), "consumer": (b, ("import",))}
        for who, names in steps.values():
            for step in names:
                was = before[who]["timings"].get(step, {"count": 0, "total_s": 0.0})
                got_step = now[who]["timings"][step]
                assert got_step["count"] > was["count"] and got_step["total_s"] > was["total_s"], (step, got_step)
                assert 0 < got_step["max_s"] < 60
        del near, away, got, small
        back_to(c, baseline)


def test_a_small_host_pool_buffer_goes_as_a_copy_by_default():
    """The handoff threshold is 64 KiB on host pools (tuning.HOST_HANDOFF_THRESHOLD), the crossover measured on the
    CPU: a 16 KiB pool buffer goes to a same-host worker as a copy in Dask's frames (fallback small, no lease),
    landing in the receiver's pool so that it can be handed on; a 64 KiB one (the threshold) is handed over. Back to
    baseline after."""
    with nanny_cluster([{}, {}], HOST_POOL) as c:
        a, b = worker_addresses(c)
        # Dask forgets the warm-up's values asynchronously; warm_up waits for that (a baseline taken before counted a
        # warm-up buffer once, in CI).
        baseline = warm_up(c, a, b)
        before = counters(c)
        small = c.submit(T.make_buffer, 16 << 10, b"small", workers=[a], pure=False)
        big = c.submit(T.make_buffer, 64 << 10, b"big", workers=[a], pure=False)
        got_small = c.submit(T.keep, small, workers=[b], pure=False)
        got_big = c.submit(T.keep, big, workers=[b], pure=False)
        assert c.submit(T.head, got_small, 5, workers=[b], pure=False).result() == b"small"
        assert c.submit(T.head, got_big, 3, workers=[b], pure=False).result() == b"big"
        assert c.submit(T.describe, got_small, workers=[b], pure=False).result() == {
            "type": "cuda.core._memory._buffer.Buffer",
            "imported": False,
            "in_own_pool": True,
        }
        assert c.submit(T.describe, got_big, workers=[b], pure=False).result()["imported"]
        now = counters(c)
        assert now[a]["fallbacks"] == {"small": 1}
        assert now[b]["copied_bytes"] - before[b]["copied_bytes"] == 16 << 10
        assert now[b]["zero_copy_bytes"] - before[b]["zero_copy_bytes"] == 64 << 10
        assert now[a]["leases"] == 1  # the big one's
        del small, big, got_small, got_big
        back_to(c, baseline)


def test_an_empty_plain_array_counts_no_fallback():
    """An empty array outside the pool copies nothing: no fallback is counted for it (seen on a GPU: the "empty"
    layout of test_every_layout_hands_over_on_a_gpu_and_passes_on counted one); a non-empty one still is."""
    import numpy as np

    with nanny_cluster([{}, {}], HOST_POOL) as c:
        a, b = worker_addresses(c)
        before = counters(c)
        empty = c.submit(np.zeros, 0, workers=[a], pure=False)
        assert c.submit(T.total, empty, workers=[b], pure=False).result() == 0.0
        assert counters(c)[a]["fallbacks"] == before[a]["fallbacks"]
        one = c.submit(np.zeros, 1, workers=[a], pure=False)
        assert c.submit(T.total, one, workers=[b], pure=False).result() == 0.0
        assert counters(c)[a]["fallbacks"] == {**before[a]["fallbacks"], "small": 1}
        del empty, one


def test_other_host_ids_copy_and_land_in_the_receivers_pool():
    hosts = [{"config": {"gpupool": {"host-id": "host-a"}}}, {"config": {"gpupool": {"host-id": "host-b"}}}]
    with nanny_cluster(hosts, HOST_POOL) as c:
        a, b = worker_addresses(c)
        before = counters(c)
        x = c.submit(T.make_buffer, MiB, b"copied", workers=[a], pure=False)
        y = c.submit(T.keep, x, workers=[b], pure=False)
        assert c.submit(T.describe, y, workers=[b], pure=False).result() == {
            "type": "cuda.core._memory._buffer.Buffer",
            "imported": False,
            "in_own_pool": True,
        }
        assert c.submit(T.head, y, 6, workers=[b], pure=False).result() == b"copied"
        now = counters(c)
        assert now[b]["copied_bytes"] - before[b]["copied_bytes"] == MiB
        assert now[b]["zero_copy_bytes"] == before[b]["zero_copy_bytes"]
        assert now[a]["leases"] == 0 and now[a]["copied_out_bytes"] - before[a]["copied_out_bytes"] == MiB
        assert now[a]["fallbacks"] == {}  # another host is not a fallback


def test_large_copies_to_another_host_are_pulled_in_chunks_and_leave_nothing():
    """Copies from tuning.COPY_STREAM_THRESHOLD (4 MiB) up go over the pipelined copy path, in chunks of
    tuning.COPY_CHUNK_SIZE (16 MiB) over up to tuning.COPY_STREAMS lanes; smaller ones in the frames."""
    import numpy as np

    hosts = [{"config": {"gpupool": {"host-id": h}}} for h in ("host-a", "host-b")]
    with nanny_cluster(hosts, HOST_POOL) as c:
        a, b = worker_addresses(c)
        baseline = warm_up(c, a, b)
        before = counters(c)
        n = 4_500_003  # two 16 MiB chunks and a short one: three lanes
        arr = c.submit(T.make_array, n, workers=[a], pure=False)
        got = c.submit(T.keep, arr, workers=[b], pure=False)
        assert c.submit(T.total, got, workers=[b], pure=False).result() == float(np.arange(n).sum())
        info = c.submit(T.describe, got, workers=[b], pure=False).result()
        assert info == {"type": "numpy.ndarray", "imported": False, "in_own_pool": True}
        big = c.submit(T.make_buffer, 6 * MiB, b"pulled", workers=[a], pure=False)
        small = c.submit(T.make_buffer, MiB, b"framed", workers=[a], pure=False)
        heads = [c.submit(T.head, x, 6, workers=[b], pure=False) for x in (big, small)]
        assert c.gather(heads) == [b"pulled", b"framed"]
        now = counters(c)
        streamed = n * 8 + 6 * MiB
        assert now[b]["streamed_bytes"] - before[b]["streamed_bytes"] == streamed
        assert now[b]["copied_bytes"] - before[b]["copied_bytes"] == streamed + MiB
        assert now[a]["streamed_out_bytes"] - before[a]["streamed_out_bytes"] == streamed
        assert now[a]["fallbacks"] == {} and now[b]["fallbacks"] == {}
        del arr, got, big, small, heads
        back_to(c, baseline)


def test_a_large_pull_runs_off_the_consumers_event_loop():
    """A 1 GiB streamed pull fills the value in a thread: the consumer's event loop keeps ticking meanwhile."""
    from distributed import wait

    plugin = GPUPool(kind="host", max_size="1100 MiB")
    hosts = [{"config": {"gpupool": {"host-id": h}}} for h in ("host-a", "host-b")]
    with nanny_cluster(hosts, plugin) as c:
        a, b = worker_addresses(c)
        baseline = warm_up(c, a, b)
        x = c.submit(T.make_buffer, GiB, b"pulled", workers=[a], pure=False)
        wait(x)
        before = counters(c, b)[b]["streamed_bytes"]
        c.run(T.start_loop_ticks, workers=[b])
        start = time.monotonic()
        y = c.submit(T.keep, x, workers=[b], pure=False)
        wait(y)
        took = time.monotonic() - start
        ticks = c.run(T.stop_loop_ticks, workers=[b])[b]
        assert c.submit(T.head, y, 6, workers=[b], pure=False).result() == b"pulled"
        assert counters(c, b)[b]["streamed_bytes"] - before == GiB
        # Blocking the loop for the pull would leave one gap as long as the pull (took).
        assert ticks["longest"] < max(0.2, took / 3), (ticks, took)
        del x, y
        back_to(c, baseline)


def test_client_gather_gets_a_host_copy():
    with nanny_cluster([{}], HOST_POOL) as c:
        (a,) = worker_addresses(c)
        x = c.submit(T.make_buffer, 4096, b"to the client", workers=[a], pure=False)
        buf = x.result()
        assert T.read_bytes(buf, 13) == b"to the client"
        assert type(buf.memory_resource).__name__ == "_HostBytes"
        assert counters(c)[a]["leases"] == 0


def test_amm_dropping_the_producers_replica_keeps_the_memory_leased():
    # nanny_cluster turns the AMM's own timer off, so that it cannot drop B's replica first;
    # the test makes the same request the AMM's ReduceReplicas policy makes, for A's replica.
    with nanny_cluster([{}, {}], HOST_POOL) as c:
        a, b = worker_addresses(c)
        baseline = warm_up(c, a, b)
        x = c.submit(T.make_buffer, MiB, b"still here", workers=[a], pure=False)
        c.submit(T.head, x, 1, workers=[b], pure=False).result()  # B now holds a replica of x
        wait_for(lambda: len(c.who_has(x)[x.key]) == 2, what="two replicas")

        def drop(dask_scheduler: Any, key: Any = x.key, addr: str = a) -> None:
            dask_scheduler.request_remove_replicas(addr, [key], stimulus_id="test-drop-replica")

        c.run_on_scheduler(drop)
        wait_for(lambda: c.who_has(x)[x.key] == (b,), what="A's replica to go")
        # A frees its key, but the lease keeps the memory: a new allocation cannot take it.
        assert counters(c)[a]["leases"] == 1 and counters(c)[a]["used"] >= MiB
        c.submit(T.scribble, MiB, b"SCRIBBLED!", workers=[a], pure=False).result()
        assert c.submit(T.head, x, 10, workers=[b], pure=False).result() == b"still here"
        x.release()
        back_to(c, baseline)


def test_fetching_one_key_twice_shares_one_import():
    """B fetches x again while it still holds its first import (AMM dropped B's replica meanwhile)."""
    import dask

    with dask.config.set({"distributed.scheduler.active-memory-manager.start": False}):
        with nanny_cluster([{}, {}], HOST_POOL) as c:
            a, b = worker_addresses(c)
            baseline = warm_up(c, a, b)
            x = c.submit(T.make_buffer, MiB, b"one allocation", workers=[a], pure=False)
            y = c.submit(T.keep, x, workers=[b], pure=False)
            y.result()

            def drop(dask_scheduler: Any, key: Any = x.key, addr: str = b) -> None:
                dask_scheduler.request_remove_replicas(addr, [key], stimulus_id="test-drop-replica")

            c.run_on_scheduler(drop)
            wait_for(lambda: c.who_has(x)[x.key] == (a,), what="B's replica of x to go")
            z = c.submit(T.keep, x, workers=[b], pure=False)
            assert c.submit(T.head, z, 14, workers=[b], pure=False).result() == b"one allocation"
            assert counters(c, a)[a]["leases"] == 2  # one lease per handoff, one import in B
            y.release()
            assert c.submit(T.head, z, 14, workers=[b], pure=False).result() == b"one allocation"
            x.release()
            z.release()
            back_to(c, baseline)


def test_sigkill_of_the_importer_releases_its_leases():
    with nanny_cluster([{}, {}], HOST_POOL) as c:
        a, b = worker_addresses(c)
        x = c.submit(T.make_buffer, MiB, b"leased", workers=[a], pure=False)
        y = c.submit(T.keep, x, workers=[b], pure=False)
        y.result()
        assert counters(c)[a]["leases"] == 1
        os.kill(pid_of(c, b), signal.SIGKILL)
        wait_for(lambda: counters(c, a)[a]["leases"] == 0, what="A to release B's lease")
        del x, y
        wait_for(lambda: counters(c, a)[a]["used"] == 0, what="A's pool bytes to return")


@pool_kinds("one-gpu")
def test_stress_producers_release_while_consumers_read(kind):
    rounds, nbytes, max_size = (10, 4 * MiB, "256 MiB") if kind == "host" else (40, 16 * MiB, "4 GiB")
    with kind_cluster(kind, max_size) as c:
        stress(c, rounds, nbytes)


@pytest.mark.parametrize("bad", [{"gpupool": {"path": "ipc", "kind": "host", "nbytes": 8}}, {"gpupool": 3}])
def test_malformed_handoff_header_is_a_protocol_error(bad):
    """Raised as a DataLostError (a ConnectionError, so Dask fetches again) caused by the ProtocolError."""
    from cuda.core import Buffer
    from distributed.protocol import dask_deserialize

    with pytest.raises(dask_gpupool.DataLostError) as info:
        dask_deserialize.dispatch(Buffer)(bad, [])
    assert isinstance(info.value.__cause__, dask_gpupool.ProtocolError)


@pytest.mark.parametrize(
    "shape, strides, offset",
    [((1000,), (8,), 0), ((2,), (8,), 8), ((2, 2), (8, -8), 0), ((3,), (16,), 0)],
    ids=["past-the-end", "offset-past-the-end", "negative-stride-before-the-start", "stride-past-the-end"],
)
def test_an_array_header_that_does_not_fit_its_buffer_is_data_lost(shape, strides, offset):
    """An array header that passes the wire check but does not fit the buffer it came with is raised as a
    DataLostError like every other failure to receive (so Dask fetches again and the comm is not left waiting),
    never as NumPy's own ValueError."""
    from dask_gpupool.dask.dask_family import KEY, loads_array
    from dask_gpupool.wire.handoff import ArrayMeta, HandoffHeader

    meta = ArrayMeta("numpy", shape, strides, "<f8", offset)
    header = {KEY: HandoffHeader("copy", "host", 16, exporter="tcp://127.0.0.1:1", array=meta).to_msg()}
    with pytest.raises(dask_gpupool.DataLostError, match=r"tcp://127\.0\.0\.1:1 could not be received") as info:
        loads_array(header, [b"\0" * 16], lambda header, frames: None)
    assert isinstance(info.value.__cause__, (dask_gpupool.GPUPoolError, ValueError))
    good = ArrayMeta("numpy", (2,), (8,), "<f8")
    header = {KEY: HandoffHeader("copy", "host", 16, exporter="tcp://127.0.0.1:1", array=good).to_msg()}
    assert loads_array(header, [b"\0" * 16], lambda header, frames: None).tolist() == [0.0, 0.0]


@pytest.mark.parametrize(
    "nbytes, frames",
    [(8, []), (8, [b"abc"]), (3, [b"abcdefgh"]), (8, [b"abcd", b"efgh"])],
    ids=["no-frame", "frame-shorter", "frame-longer", "two-frames"],
)
def test_a_copy_header_whose_frames_do_not_hold_its_bytes_is_data_lost(nbytes, frames):
    """A ``copy`` header comes with exactly one frame of ``nbytes`` bytes (distributed merges split frames back
    before the deserializer runs). A message that does not (no frame, a frame of another size, frames to spare)
    is malformed: raised as a DataLostError caused by a ProtocolError, never a Buffer of the wrong size (a value
    silently wrong). The well-formed one still lands."""
    from cuda.core import Buffer
    from distributed.protocol import dask_deserialize

    from dask_gpupool.dask.dask_family import KEY
    from dask_gpupool.testing import read_bytes
    from dask_gpupool.wire.handoff import HandoffHeader

    header = {KEY: HandoffHeader("copy", "host", nbytes, exporter="tcp://127.0.0.1:1").to_msg()}
    with pytest.raises(dask_gpupool.DataLostError, match=r"tcp://127\.0\.0\.1:1 could not be received") as info:
        dask_deserialize.dispatch(Buffer)(header, frames)
    assert isinstance(info.value.__cause__, dask_gpupool.ProtocolError)
    good = {KEY: HandoffHeader("copy", "host", 8, exporter="tcp://127.0.0.1:1").to_msg()}
    got = dask_deserialize.dispatch(Buffer)(good, [b"abcdefgh"])
    assert int(got.size) == 8 and read_bytes(got, 8) == b"abcdefgh"
    empty = {KEY: HandoffHeader("copy", "host", 0, exporter="tcp://127.0.0.1:1").to_msg()}
    assert int(dask_deserialize.dispatch(Buffer)(empty, [b""]).size) == 0


def test_handoff_replies_skip_the_offload_thread_and_copies_keep_it():
    """Dask offloads serializing any reply over 10 MiB (by sizeof) to a thread; a reply of
    descriptors only is serialized on the event loop (0.5 ms less per transfer)."""
    import numpy as np

    with nanny_cluster([{}, {}], HOST_POOL) as c:
        a, b = worker_addresses(c)
        pooled = c.submit(T.make_array, 4 * MiB, workers=[a], pure=False)
        plain = c.submit(np.ones, 4 * MiB, workers=[a], pure=False)
        c.gather([pooled, plain])

        def inline(keys: list[str], who: str) -> bool:
            return c.run(T.serialized_inline, keys, who, workers=[a])[a]

        assert inline([pooled.key], b)
        assert not inline([plain.key], b)  # a copy: its serialization stays in the thread
        assert not inline([pooled.key, plain.key], b)
        assert not inline([pooled.key], a)  # same process
        assert not inline([pooled.key], "tcp://127.0.0.1:1")  # not a registered worker (a client)
        assert not inline(["no-such-key"], b)
        small = c.submit(T.make_array, 128, workers=[a], pure=False)
        c.gather(small)
        assert not inline([small.key], b)  # under Dask's offload threshold: nothing to gain, no check
        # over UCX, host pool memory to a requester that cannot map it is a host frame: it stays in the thread
        # (device pool memory, staged for UCX on the loop, is on the GPU machine)
        assert not c.run(T.serialized_inline, [pooled.key], "tcp://127.0.0.1:1", scheme="ucxx", workers=[a])[a]
        # and the handoff itself still works
        assert c.submit(T.total, pooled, workers=[b], pure=False).result() == float(sum(range(4 * MiB)))


def test_a_failed_cupy_registration_is_retried_not_marked_done():
    """Without CuPy the registration fails each time it is asked for, and never counts as done
    (a dask-cuda worker once lost its CuPy deserializer to a registration marked done too early).
    Run in a fresh process where ``import cupy`` fails, whether or not CuPy is installed."""
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['cupy'] = None\n"
        "from dask_gpupool.dask import registration as _serialize\n"
        "for _ in range(2):\n"
        "    try:\n"
        "        _serialize.register_cupy()\n"
        "    except ImportError:\n"
        "        pass\n"
        "    else:\n"
        "        raise SystemExit('registered without CuPy')\n"
        "    assert _serialize._cupy_registered == 'no', _serialize._cupy_registered\n"
        "print('retried, never done')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "retried, never done" in out.stdout, out.stderr[-2000:]


def _numpy_result(n: int) -> Any:
    """Task: an array NumPy allocated itself, put in the pool."""
    import numpy as np

    return dask_gpupool.to_pool(np.arange(n, dtype="f8").reshape(2, -1).T)  # a strided view, copied in C order


def _to_pool_twice() -> bool:
    """Task: an array in the pool already is not copied again."""
    import numpy as np

    once = dask_gpupool.to_pool(np.ones(4))
    return dask_gpupool.to_pool(once) is once


def test_to_pool_puts_a_library_array_in_the_pool_so_it_hands_over_zero_copy():
    """dask_gpupool.to_pool (what the ETL example would otherwise hand-write)."""
    import numpy as np

    assert dask_gpupool.to_pool(arr := np.ones(3)) is arr  # outside a worker: the array itself
    with pytest.raises(TypeError, match=r"to_pool takes a NumPy or CuPy array, not builtins\.list"):
        dask_gpupool.to_pool([1, 2])
    with nanny_cluster([{}, {}], GPUPool(kind="host", max_size="64 MiB")) as c:
        a, b = worker_addresses(c)
        baseline = warm_up(c, a, b)
        before = counters(c, b)[b]["zero_copy_bytes"]
        x = c.submit(_numpy_result, 1 << 20, workers=[a], pure=False)
        total = c.submit(lambda arr: (float(arr[:, 1].sum()), arr.flags.c_contiguous), x, workers=[b], pure=False)
        assert total.result() == (float(np.arange(1 << 19, 1 << 20).sum()), True)
        assert counters(c, b)[b]["zero_copy_bytes"] - before == 8 << 20
        assert c.submit(_to_pool_twice, workers=[a], pure=False).result()
        del x, total
        back_to(c, baseline)


def test_on_a_comm_that_asks_for_device_frames_a_host_buffer_still_goes_in_a_host_frame():
    """The "cuda" serializer family (UCX comms) takes device Buffers only; host memory falls through
    to ours in the "dask" family, and the frame type UCX reads is shaped as distributed-ucxx expects."""
    from distributed.protocol import deserialize, serialize

    from dask_gpupool.dask.cuda_family import _DeviceFrame
    from dask_gpupool.memory.buffers import host_buffer

    buf = host_buffer(bytearray(b"host bytes"))
    header, frames = serialize(buf, serializers=("cuda", "dask", "pickle", "error"))
    assert header["serializer"] == "dask"
    back = deserialize(header, frames, deserializers=("cuda", "dask", "pickle", "error"))
    from dask_gpupool.testing import read_bytes

    assert read_bytes(back, 10) == b"host bytes"
    frame = _DeviceFrame(0x1000, 64, owner=buf)
    assert frame.nbytes == 64 and frame.__cuda_array_interface__["shape"] == (64,)
    assert frame.__cuda_array_interface__["data"] == (0x1000, False) and frame.owner is buf


def test_arrays_outside_the_pool_get_exactly_distributeds_serialization():
    """The NumPy wrapper hands every array that is not over a pool buffer to distributed's own serializer,
    with or without a context (decided once; benchmarks/serializer_overhead.py times it)."""
    import distributed.protocol.numpy as distributed_numpy
    import numpy as np
    from distributed.protocol import dask_serialize

    from dask_gpupool.dask.registration import _with_context

    x = np.arange(10.0)
    ours = dask_serialize.dispatch(np.ndarray)
    assert ours is not distributed_numpy.serialize_numpy_ndarray
    h1, f1 = ours(x)
    h2, f2 = distributed_numpy.serialize_numpy_ndarray(x)
    assert h1 == h2 and [bytes(f) for f in f1] == [bytes(f) for f in f2]
    seen = []
    _with_context(lambda x, context=None: seen.append(context))(x, "ctx")
    _with_context(lambda x: seen.append("none"))(x, "ctx")
    assert seen == ["ctx", "none"]


def test_ucx_staging_sizes_round_to_few_classes():
    """Staging copies for UCX are kept for reuse by size class (powers of two to 64 MiB, then 64 MiB steps)."""
    from dask_gpupool.memory.ucx_staging import size_class

    MiB = 1 << 20
    assert [size_class(n) for n in (0, 1, MiB)] == [MiB] * 3
    assert [size_class(n) for n in (MiB + 1, 3 * MiB, 64 * MiB)] == [2 * MiB, 4 * MiB, 64 * MiB]
    assert [size_class(n) for n in (64 * MiB + 1, 1 << 30, (8 << 30) + 5)] == [128 * MiB, 1 << 30, (8 << 30) + 64 * MiB]
