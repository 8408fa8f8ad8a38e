"""The arena placement's stream order, with stand-in streams and events (no GPU needed).

:class:`~dask_gpupool.memory.arena_placement.ArenaPlacement` takes the GPU's default stream as a collaborator (the
resource's ``HomeStream``); here it gets a stand-in that counts the work queued on each stream and logs what each
stream was made to wait for, so that the ordering itself is checked on every commit. The same order with cuda.core's
streams runs on a GPU (``tests/memory/test_device_memory.py``).
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any

from cuda.core import Buffer

from dask_gpupool.memory.arena_placement import ArenaPlacement
from dask_gpupool.memory.host import HostOnlyResource
from dask_gpupool.memory.retire import RetireLedger
from dask_gpupool.memory.segment_source import SegmentSource
from dask_gpupool.memory.segment_table import SegmentTable

MiB = 1 << 20


class Event:
    """A stand-in for a cuda.core event: the point of its stream's work it marks, and whether that work has run."""

    def __init__(self, stream: Stream) -> None:
        self.stream = stream
        self.at = 0
        self.is_done = False
        self.closed = False

    def sync(self) -> None:
        self.is_done = True

    def close(self) -> None:
        self.closed = True


class Stream:
    """A stand-in for a cuda.core stream: counts the work queued on it, and logs the events it was made to wait for
    as ``(stream handle, point)``."""

    def __init__(self, handle: int) -> None:
        self.handle = handle
        self.queued = 0
        self.waits: list[tuple[int, int]] = []
        self.events: list[Event] = []  # every event made here (recording one again makes none)

    def launch(self) -> None:
        self.queued += 1

    def record(self, event: Event | None = None) -> Event:
        if event is None:
            event = Event(self)
            self.events.append(event)
        event.at, event.is_done = self.queued, False
        return event

    def wait(self, event: Event) -> None:
        assert isinstance(event, Event), f"waited for {event!r}: a whole stream, not a point of it"
        self.waits.append((event.stream.handle, event.at))


class Home:
    """A stand-in for :class:`~dask_gpupool.memory.home_stream.HomeStream`: the default stream, handle 1."""

    def __init__(self) -> None:
        self.stream = Stream(1)
        self.handle: int | None = None

    def __call__(self) -> Stream:
        self.handle = self.stream.handle
        return self.stream

    def sync(self) -> None:
        for event in self.stream.events:
            event.sync()


class HostMemory(HostOnlyResource):
    """Plain host memory for the segments (nothing is read or written)."""

    def __init__(self) -> None:
        self.live: dict[int, Any] = {}

    def allocate(self, size: int, *, stream: Any = None) -> Buffer:
        raw = ctypes.create_string_buffer(size)
        self.live[ctypes.addressof(raw)] = raw
        return Buffer.from_handle(ctypes.addressof(raw), size, mr=self)

    def deallocate(self, ptr: Any, size: int, *, stream: Any = None) -> None:
        del self.live[int(ptr)]


def placement() -> tuple[ArenaPlacement, SegmentTable, Home]:
    """An arena placement over segments of 8 MiB of host memory, with a stand-in default stream."""
    table, lock, home = SegmentTable(), threading.RLock(), Home()
    source = SegmentSource(HostMemory(), lambda b: b"", table, lock, RetireLedger(), None)
    return ArenaPlacement(table, lock, source.new, 8 * MiB, home), table, home  # type: ignore[arg-type]


def free(where: ArenaPlacement, table: SegmentTable, ptr: int, stream: Stream | None) -> None:
    found = table.locate(ptr)
    assert found is not None
    assert where.free(*found, stream)


def test_another_stream_waits_for_the_frees_on_the_default_stream_not_for_its_later_work():
    """A staging copy on a stream of its own while the default stream is busy: a range freed on the default stream
    is reused at once, and the other stream waits for that free only, not for the kernels queued there after it (as
    RMM's stream-ordered pool does). An allocation on the default stream waits for nothing."""
    arena, table, home = placement()
    default, side = home.stream, Stream(2)
    a = arena.allocate(4096, default)
    default.launch()  # a task writes a
    free(arena, table, a, None)  # freed on the default stream
    freed_at = default.queued
    default.launch()  # a later task's kernel, still queued
    default.launch()
    b = arena.allocate(4096, side)
    assert b == a  # the range, reused at once
    assert side.waits == [(default.handle, freed_at)]  # after the free, not after the later kernels
    assert arena.allocate(4096, default) != a and default.waits == []


def test_the_latest_free_on_the_default_stream_is_waited_for_with_one_event_recorded_again():
    """Each free on the default stream records the same event again (one event, not one per free), at the latest
    free, which follows every earlier one; an allocation on another stream waits for the frees until then."""
    arena, table, home = placement()
    default, side = home.stream, Stream(2)
    ptrs = [arena.allocate(4096, default) for _ in range(3)]
    for ptr in ptrs:
        default.launch()
        free(arena, table, ptr, None)
    assert len(default.events) == 1 and default.events[0].at == 3
    arena.allocate(4096, side)
    assert side.waits == [(default.handle, 3)]
    default.launch()
    default.launch()
    c = arena.allocate(4096, default)
    free(arena, table, c, None)
    arena.allocate(4096, side)
    assert side.waits[-1] == (default.handle, 5) and len(default.events) == 1


def test_a_range_freed_on_another_stream_is_reused_once_its_event_completed():
    """A range freed on a stream other than the default one is pending until the event recorded there at the free
    completed: meanwhile another range is placed, after it the range is reused (and its event closed)."""
    arena, table, home = placement()
    default, side = home.stream, Stream(2)
    a = arena.allocate(4096, side)
    side.launch()  # a copy reads a
    free(arena, table, a, side)
    (event,) = side.events
    assert event.at == 1 and not event.is_done
    b = arena.allocate(4096, default)
    assert b != a  # still pending
    event.sync()  # the copy has run
    assert arena.allocate(4096, default) == a and event.closed
    assert default.waits == [] and side.waits == []


def test_closing_closes_every_event_the_placement_owns():
    """Close counts the pending frees as done and closes the events the placement owns: the pending frees' and the
    one recorded at the default stream's frees."""
    arena, table, home = placement()
    default, side = home.stream, Stream(2)
    other = arena.allocate(4096, default)
    free(arena, table, other, None)
    pending = arena.allocate(4096, side)
    free(arena, table, pending, side)
    with arena._lock:
        arena.close()
    assert len(default.events) == len(side.events) == 1
    assert all(e.closed for e in default.events + side.events)
    assert table.used == 0
    assert not arena.free(*table.locate(other), None)  # type: ignore[misc]  # closed: nothing taken back


def test_a_full_segment_waits_for_the_frees_pending_on_other_streams_before_taking_another():
    """When no segment has room for a buffer, the frees pending on other streams are waited for (their events
    synchronized) and the range tried again, before a new segment is taken from the upstream."""
    arena, table, home = placement()
    default, side = home.stream, Stream(2)
    whole = arena.allocate(8 * MiB, side)  # the whole first segment
    side.launch()
    free(arena, table, whole, side)
    assert arena.allocate(8 * MiB, default) == whole
    assert len(table) == 1 and side.events[0].closed
