"""The deferred copies of :mod:`dask_gpupool.handoff.deferred`, without a cluster."""

from __future__ import annotations

import contextvars

import pytest

from dask_gpupool.handoff.deferred import abandon_all, collecting, fill_later, run_fills


def test_without_a_collector_a_fill_runs_at_once():
    log: list[str] = []
    fill_later(lambda: log.append("run"), lambda: log.append("abandon"))
    assert log == ["run"]


def test_a_fill_that_fails_at_once_is_abandoned_and_raises():
    log: list[str] = []

    def fail() -> None:
        raise OSError("broken")

    with pytest.raises(OSError, match="broken"):
        fill_later(fail, lambda: log.append("abandon"))
    assert log == ["abandon"]


def test_a_collector_keeps_fills_until_the_caller_runs_them():
    log: list[str] = []
    with collecting() as fills:
        fill_later(lambda: log.append("a"), lambda: log.append("abandon a"))
        fill_later(lambda: log.append("b"), lambda: log.append("abandon b"))
        assert log == [] and fills == []  # handed over when the block is left
    assert len(fills) == 2
    run_fills(fills)
    assert log == ["a", "b"]
    fill_later(lambda: log.append("c"), lambda: None)  # the collector is gone: at once
    assert log == ["a", "b", "c"]


def test_after_a_failed_fill_the_rest_are_abandoned_and_the_error_raised():
    log: list[str] = []

    def fail() -> None:
        log.append("b fails")
        raise ConnectionError("lane lost")

    with collecting() as fills:
        fill_later(lambda: log.append("a"), lambda: log.append("abandon a"))
        fill_later(fail, lambda: log.append("abandon b"))
        fill_later(lambda: log.append("c"), lambda: log.append("abandon c"))
    with pytest.raises(ConnectionError, match="lane lost"):
        run_fills(fills)
    assert log == ["a", "b fails", "abandon b", "abandon c"]


def test_abandon_all_gives_up_every_fill():
    log: list[str] = []
    with collecting() as fills:
        fill_later(lambda: log.append("a"), lambda: log.append("abandon a"))
    abandon_all(fills)
    assert log == ["abandon a"]


def test_a_context_copied_inside_the_block_keeps_no_fills_and_runs_late_ones_at_once():
    """Tasks started inside the block copy the context: the collector they see is closed and emptied on leaving."""
    with collecting() as fills:
        fill_later(lambda: None, lambda: None)
        copied = contextvars.copy_context()
    assert len(fills) == 1
    (collector,) = [v for k, v in copied.items() if k.name == "gpupool_pending_fills"]
    assert collector.fills == [] and not collector.open
    log: list[str] = []
    copied.run(fill_later, lambda: log.append("late"), lambda: None)  # a late deserializer there
    assert log == ["late"]
