"""Helpers of dask/plain_arrays.py that need no GPU."""

from __future__ import annotations

import logging

from dask_gpupool.dask.plain_arrays import _contiguous_strides, warn_once


def test_a_failed_shortcut_is_logged_once_with_what_is_done_instead(caplog):
    with caplog.at_level(logging.WARNING, logger="dask_gpupool.dask.plain_arrays"):
        for _ in range(3):
            warn_once("testing a shortcut", RuntimeError("no room"), "the slow way is taken")
        warn_once("testing another shortcut", ValueError("bad"), "the other slow way")
    messages = [r.getMessage() for r in caplog.records]
    assert messages == [
        "gpupool: testing a shortcut failed (RuntimeError: no room); the slow way is taken. Further cases are not "
        "logged.",
        "gpupool: testing another shortcut failed (ValueError: bad); the other slow way. Further cases are not logged.",
    ]


def test_one_copy_of_the_bytes_is_taken_only_for_c_or_fortran_contiguous_arrays():
    """``_contiguous_strides``: the strides of a byte-for-byte copy of C- and Fortran-contiguous arrays (0-d and
    size-1 axes included; those strides are canonical, whatever the view's), ``None`` for every other layout, whose
    copy goes through the array library. NumPy here; the CuPy path is the GPU test of every layout."""
    import numpy as np

    a = np.arange(24, dtype="f8").reshape(2, 3, 4)
    assert _contiguous_strides(a) == a.strides == (96, 32, 8)
    assert _contiguous_strides(a.T) == a.T.strides == (8, 32, 96)
    assert _contiguous_strides(a.reshape(24)[5:6].reshape(())) == ()
    odd = a.reshape(2, 12)[:, None, :]  # a size-1 axis of stride 0: still C-contiguous
    assert odd.strides == (96, 0, 8) and _contiguous_strides(odd) == (96, 96, 8)
    for other in (a[:, ::2], a[:, :1, :], a[::-1], np.broadcast_to(a[0, 0], (5, 4)), a.transpose(1, 0, 2)):
        assert _contiguous_strides(other) is None
    for arr in (a, a.T, odd):  # the strides describe the copied bytes
        copy = np.frombuffer(arr.tobytes(order="A"), dtype=arr.dtype)
        view = np.lib.stride_tricks.as_strided(copy, arr.shape, _contiguous_strides(arr))
        assert (view == arr).all()
