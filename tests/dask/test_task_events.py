"""The table of task-result events that staging copies and exports wait for (dask/task_events.py), without a GPU.

NumPy arrays stand in for CuPy results (``wanted``) and plain objects for the events (``record``): what is tested
is the table (identity, keys, weak references), not CUDA, which the ``gpu`` tests exercise.
"""

from __future__ import annotations

import gc

import numpy as np

from dask_gpupool.dask.task_events import TaskEvents, is_cupy_array


def table() -> tuple[TaskEvents, list[object]]:
    made: list[object] = []

    def record() -> object:
        made.append(object())
        return made[-1]

    return TaskEvents(record, wanted=lambda v: isinstance(v, np.ndarray)), made


def test_a_stored_result_has_its_event_and_an_equal_copy_has_none():
    events, made = table()
    x = np.arange(4)
    events.stored("x", x)
    assert events.event_of(x) is made[0]
    assert events.event_of(x.copy()) is None  # another object, even with the same values
    assert events.event_of(x[1:]) is None  # a view is another object too: its copy is ordered as before


def test_only_wanted_results_are_recorded():
    events, made = table()
    events.stored("b", b"bytes")
    events.stored("n", 3)
    assert (len(events), made) == (0, [])


def test_an_entry_ends_when_its_key_leaves_memory_or_its_result_is_collected():
    events, _ = table()
    x, y = np.arange(4), np.arange(5)
    events.stored("x", x)
    events.stored("y", y)
    events.released("x")
    assert events.event_of(x) is None and len(events) == 1
    del y
    gc.collect()
    assert len(events) == 0  # the table holds no reference to the result: it was collected, and its entry with it
    events.released("y")  # nothing left to forget: no error


def test_a_key_stored_again_has_only_its_new_result():
    events, made = table()
    first, second = np.arange(4), np.arange(4)
    events.stored("x", first)
    events.stored("x", second)  # recomputed
    assert events.event_of(first) is None
    assert events.event_of(second) is made[1]
    assert len(events) == 1
    events.clear()
    assert events.event_of(second) is None and len(events) == 0


def test_cupy_arrays_are_told_by_their_module_without_importing_cupy():
    assert not is_cupy_array(np.arange(3))  # NumPy's has no __cuda_array_interface__ and another module
    assert not is_cupy_array(memoryview(b"x"))


def test_the_worker_says_why_it_stages_or_not():
    """``stats()["routing"]["staging"]``: the plugin records task events only where it stages (on a UCX comm at
    ``auto`` it stages nothing, so records nothing either)."""
    from dask_gpupool.dask.worker_setup import staging_line

    assert staging_line("device", True, False).startswith("off: over UCX")
    assert staging_line("device", True, True).startswith("on: plain CuPy results of 64.00 kiB or more")
    assert staging_line("device", False, True) == "off: CuPy is not installed"
    assert staging_line("host", True, True).startswith("on: plain NumPy results of 1.00 MiB to 512.00 MiB")
    assert staging_line("pinned", True, True) == "off: a pinned pool stages no plain arrays"


def test_the_worker_plugin_wants_an_event_for_its_own_pool_buffers_only(tmp_path, no_fd_leak):
    """``wants_event``: a task result that is a Buffer of this worker's pool gets an event (its export waits for it
    rather than for the whole GPU, ``gpupool.handoff-ordering: sync``); a Buffer of another pool, a NumPy array and
    other values do not. A ``host`` pool stands in for the pool kind (the CUDA kinds run in the ``gpu`` tests)."""
    from dask_gpupool import PoolOptions
    from dask_gpupool.dask.worker_setup import wants_event
    from dask_gpupool.handoff.startup import start_service

    options = PoolOptions.from_config(kind="host", max_size="1 MiB", broker_dir=str(tmp_path))
    a = start_service(options, "tcp://127.0.0.1:40001")
    b = start_service(options, "tcp://127.0.0.1:40002")
    try:
        wanted = wants_event(a, 64 * 1024)
        own, other = a.pool.allocate(4096), b.pool.allocate(4096)
        assert wanted(own)
        assert not wanted(other)
        assert not wanted(np.zeros(1 << 20, dtype="u1"))  # not a CuPy array, whatever its size
        assert not wanted(b"bytes") and not wanted(3)
        own.close()
        other.close()
    finally:
        b.close()
        a.close()


def test_the_segment_memory_line_says_what_segments_are_made_of_and_why():
    """``stats()["routing"]["segment-memory"]``: ``auto`` makes legacy IPC segments on a UCX worker (UCX sends them
    with no staging copy), VMM ones over TCP, each the other where the GPU lacks it; a set value is named as such."""
    from dask_gpupool.config import PoolOptions
    from dask_gpupool.dask.worker_setup import segment_memory_line

    auto = PoolOptions.from_config()
    assert segment_memory_line(auto, "device", "legacy", True).startswith("legacy (auto): this worker listens over UCX")
    assert segment_memory_line(auto, "device", "vmm", False) == "vmm (auto): this worker does not listen over UCX"
    assert segment_memory_line(auto, "device", "vmm", True) == "vmm (auto): this GPU shares no memory by IPC handle"
    assert segment_memory_line(auto, "host", "pool", False) == "none: a host pool has no segments"
    legacy = PoolOptions.from_config(segment_memory="legacy")
    assert segment_memory_line(legacy, "device", "legacy", False) == "legacy (gpupool.segment-memory)"
    assert segment_memory_line(auto, "device", "legacy", False) == (
        "legacy (auto): this GPU exports no virtual memory as POSIX fds"
    )
