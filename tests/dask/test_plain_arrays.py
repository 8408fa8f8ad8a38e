"""Helpers of dask/plain_arrays.py that need no GPU."""

from __future__ import annotations

import logging

from dask_gpupool.dask.plain_arrays import warn_once


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
