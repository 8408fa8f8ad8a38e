"""A segmented resource's home: its GPU's default stream, with the GPU made current in the calling thread.

CUDA calls run against the calling thread's current context, and a
:class:`~dask_gpupool.memory.segments.SegmentedResource` is called on many
threads (task threads allocate, any thread, the garbage collector's included,
deallocates), so every CUDA path of the resource and of its placements starts
by calling its :class:`HomeStream`. A range freed on the home stream is
reused at once there, and on another stream after an event recorded at the
home stream's latest free; frees on other streams are ordered by events
(:mod:`dask_gpupool.memory.arena_placement`).
"""

from __future__ import annotations

from typing import Any

__all__ = ["HomeStream"]


class HomeStream:
    """GPU ``ordinal``'s default stream; calling it makes the GPU current in the calling thread.

    Parameters
    ----------
    ordinal : int
        The GPU the segments live on.

    Attributes
    ----------
    ordinal : int
    handle : int or None
        The default stream's handle, once the home was first called
        (``None`` before).

    Notes
    -----
    Owns nothing: cuda.core owns the device and its default stream. The
    device is looked up on the first call, without a lock (two threads may
    both look it up; they get the same stream).
    """

    ordinal: int
    handle: int | None
    _dev: Any
    _stream: Any

    def __init__(self, ordinal: int) -> None:
        self.ordinal = ordinal
        self.handle = None
        self._dev = self._stream = None

    def __call__(self) -> Any:
        """The GPU's default stream, with the GPU made current."""
        dev = self._dev
        if dev is None:
            from cuda.core import Device

            dev = self._dev = Device(self.ordinal)
            dev.set_current()
            self._stream = dev.default_stream
            self.handle = int(self._stream.handle)
        else:
            dev.set_current()
        return self._stream

    def sync(self) -> None:
        """Make the GPU current and wait until the work queued on any of its streams has run."""
        self()
        self._dev.sync()
