"""The deferred copies of :mod:`dask_gpupool.handoff.deferred`, without a cluster."""

from __future__ import annotations

import contextvars

import pytest

from dask_gpupool.handoff.deferred import (
    Later,
    abandon_all,
    claim_later,
    collecting,
    fill_later,
    make_later,
    resolve,
    run_fills,
)


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


def test_without_a_collector_a_claim_runs_at_once_and_a_refusal_closes_the_buffer():
    log: list[object] = []
    claim_later("broker-a", 7, lambda leases: log.append(("claim", leases)), lambda: log.append("close"))
    assert log == [("claim", [7])]

    def refuse(leases: list[int]) -> None:
        raise ConnectionError(f"refused {leases}")

    with pytest.raises(ConnectionError, match=r"refused \[8\]"):
        claim_later("broker-a", 8, refuse, lambda: log.append("close 8"))
    assert log[-1] == "close 8"


def test_claims_of_one_message_go_once_per_exporter_and_before_its_fills():
    """Inside a comm read: nothing is claimed until the caller runs the fills; then one claim per exporter with all
    its leases, before any copy (a copy may read an imported buffer: only after its lease is held)."""
    log: list[object] = []
    with collecting() as fills:
        claim_later("broker-a", 1, lambda leases: log.append(("a", leases)), lambda: log.append("close 1"))
        fill_later(lambda: log.append("copy"), lambda: log.append("abandon copy"))
        claim_later("broker-b", 2, lambda leases: log.append(("b", leases)), lambda: log.append("close 2"))
        claim_later("broker-a", 3, lambda leases: log.append(("a again", leases)), lambda: log.append("close 3"))
        assert log == []
    assert len(fills) == 3
    run_fills(fills)
    assert log == [("a", [1, 3]), ("b", [2]), "copy"]


def test_a_refused_claim_closes_every_buffer_of_its_exporter_and_abandons_the_rest():
    log: list[object] = []

    def refuse(leases: list[int]) -> None:
        raise ConnectionError("lease ended")

    with collecting() as fills:
        claim_later("broker-a", 1, refuse, lambda: log.append("close 1"))
        claim_later("broker-a", 2, refuse, lambda: log.append("close 2"))
        claim_later("broker-b", 3, lambda leases: log.append(("b", leases)), lambda: log.append("close 3"))
        fill_later(lambda: log.append("copy"), lambda: log.append("abandon copy"))
    with pytest.raises(ConnectionError, match="lease ended"):
        run_fills(fills)
    assert log == ["close 1", "close 2", "close 3", "abandon copy"]


def test_a_fill_that_fails_after_the_claims_tells_each_exporter_whose_claim_ran():
    """A later fill (a copy out of mapped memory) fails: the transfer fails, and the exporters whose claims ran
    are told once each (they then send copies, so Dask's retry cannot fail the same way). A refused claim tells no
    one: its own exporter settles the unclaimed leases, and the others' values hand over fine on the retry."""
    log: list[object] = []

    def refuse(leases: list[int]) -> None:
        raise ConnectionError("lease ended")

    def broken() -> None:
        raise RuntimeError("CUDA_ERROR_INVALID_CONTEXT")

    with collecting() as fills:
        claim_later("broker-a", 1, lambda leases: log.append(("a", leases)), lambda: None, lambda: log.append("a told"))
        claim_later("broker-a", 2, lambda leases: log.append(("a", leases)), lambda: None, lambda: log.append("no"))
        claim_later("broker-b", 3, lambda leases: log.append(("b", leases)), lambda: None, lambda: log.append("b told"))
        fill_later(broken, lambda: log.append("abandon copy"))
    with pytest.raises(RuntimeError, match="INVALID_CONTEXT"):
        run_fills(fills)
    assert log == [("a", [1, 2]), ("b", [3]), "abandon copy", "a told", "b told"]

    log.clear()
    with collecting() as fills:
        claim_later("broker-a", 4, lambda leases: log.append(("a", leases)), lambda: None, lambda: log.append("a told"))
        claim_later("broker-b", 5, refuse, lambda: log.append("close 5"), lambda: log.append("b told"))
        fill_later(lambda: log.append("copy"), lambda: log.append("abandon copy"))
    with pytest.raises(ConnectionError, match="lease ended"):
        run_fills(fills)
    assert log == [("a", [4]), "close 5", "abandon copy"]


# -- values a fill makes (make_later, resolve): deserializers that may read the memory they were given


def test_without_a_collector_a_later_value_is_made_at_once():
    assert make_later(lambda: "value", lambda: None) == "value"


def test_a_later_value_is_made_after_the_claims_and_put_in_place_at_any_depth():
    log: list[str] = []

    def make() -> str:
        log.append("make")
        return "rebuilt"

    with collecting() as fills:
        fill_later(lambda: log.append("copy"), lambda: None)
        claim_later("broker-a", 7, lambda leases: log.append(f"claim {leases}"), lambda: None)
        later = make_later(make, lambda: log.append("abandon"))
        other = make_later(lambda: "other", lambda: None)
        assert isinstance(later, Later) and log == []
        msg = {"status": "OK", "data": {"k": [1, (later, "x")], "other": other}}
    assert fills.laters == [later, other]
    with pytest.raises(RuntimeError, match="before the fill"):
        resolve(msg, fills.laters)
    run_fills(fills)
    assert log == ["claim [7]", "copy", "make"]  # the claims first, then the fills in the order they were left
    assert resolve(msg, fills.laters) == {"status": "OK", "data": {"k": [1, ("rebuilt", "x")], "other": "other"}}


def test_a_later_value_is_abandoned_when_its_claim_is_refused():
    log: list[str] = []

    def refuse(leases: list[int]) -> None:
        raise ConnectionError("lease refused")

    with collecting() as fills:
        claim_later("broker-a", 7, refuse, lambda: log.append("close import"))
        make_later(lambda: log.append("make"), lambda: log.append("drop frames"))
    with pytest.raises(ConnectionError, match="refused"):
        run_fills(fills)
    assert log == ["close import", "drop frames"]  # never made: nothing read the memory


def test_resolve_says_when_a_later_value_is_not_in_the_message():
    with collecting() as fills:
        later = make_later(lambda: "v", lambda: None)
    run_fills(fills)
    assert resolve({"s": {later}}, fills.laters) == {"s": {"v"}}
    with pytest.raises(RuntimeError, match="not in the message"):
        resolve({"other": object.__new__(Later)}, fills.laters)


def test_resolve_keeps_containers_without_a_later_value_and_walks_each_container_once():
    with collecting() as fills:
        later = make_later(lambda: "v", lambda: None)
    run_fills(fills)
    untouched = list(range(1000))
    loop: list[object] = [later]
    loop.append(loop)  # self-referencing: walked once, no RecursionError
    out = resolve({"a": untouched, "b": (untouched, later), "c": loop}, fills.laters)
    assert out["a"] is untouched and out["b"][0] is untouched and out["b"][1] == "v"
    assert out["c"] is loop or out["c"][0] == "v"


def test_an_abandon_that_fails_does_not_stop_the_others():
    log: list[str] = []

    def fail() -> None:
        raise ConnectionError("lost")

    def broken_abandon() -> None:
        raise RuntimeError("close failed")

    with collecting() as fills:
        fill_later(fail, lambda: log.append("abandon a"))
        fill_later(lambda: log.append("b"), broken_abandon)
        fill_later(lambda: log.append("c"), lambda: log.append("abandon c"))
    with pytest.raises(ConnectionError, match="lost"):
        run_fills(fills)
    assert log == ["abandon a", "abandon c"]
