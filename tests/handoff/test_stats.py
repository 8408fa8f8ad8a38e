"""Every fallback reason the code can count is named, explained and comes with advice."""

from __future__ import annotations

import logging
import re
from pathlib import Path

from dask_gpupool.handoff.stats import (
    FALLBACK_ADVICE,
    FALLBACK_REASONS,
    TIMED_STEPS,
    HandoffStats,
    quantile_s,
    subtract_hist,
)

PACKAGE = Path(__file__).resolve().parents[2] / "dask_gpupool"


def reasons_in_the_code() -> set[str]:
    found: set[str] = set()
    for path in PACKAGE.rglob("*.py"):
        text = path.read_text()
        found.update(re.findall(r'reason = "([a-z-]+)"', text))
        found.update(re.findall(r'Route\([A-Za-z]+, "([a-z-]+)"\)', text))
        found.update(re.findall(r'\.fallback\([^)]*?"([a-z-]+)"', text, re.S))
    return found


def test_every_counted_reason_is_explained_and_advised():
    used = reasons_in_the_code()
    assert {"comm", "not-in-pool", "peer-unreachable", "unknown-requester", "import-failed"} <= used
    assert used <= set(FALLBACK_REASONS), used - set(FALLBACK_REASONS)
    assert set(FALLBACK_ADVICE) == set(FALLBACK_REASONS)


def test_a_fallback_is_counted_each_time_and_warned_once_per_peer_and_reason_with_advice(caplog):
    stats = HandoffStats()
    with caplog.at_level(logging.WARNING, logger="dask_gpupool"):
        for _ in range(3):
            stats.fallback("tcp://10.0.0.2:1", "not-in-pool", "tcp://10.0.0.1:1")
        stats.fallback("tcp://10.0.0.3:1", "not-in-pool", "tcp://10.0.0.1:1")
    assert stats.to_msg()["fallbacks"] == {"not-in-pool": 4}
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2  # one per peer
    assert all("To hand it over: make the result in the pool" in w for w in warnings)


def test_fallbacks_that_are_the_best_path_are_logged_at_info_not_warning(caplog):
    stats = HandoffStats()
    with caplog.at_level(logging.INFO, logger="dask_gpupool"):
        stats.fallback("tcp://10.0.0.2:1", "small", "tcp://10.0.0.1:1")
        stats.fallback("tcp://10.0.0.2:1", "staged-in-pool", "tcp://10.0.0.1:1")
        stats.fallback("tcp://10.0.0.2:1", "not-in-pool", "tcp://10.0.0.1:1")
    levels = {r.getMessage().split("(")[1].split(":")[0]: r.levelname for r in caplog.records}
    assert levels == {"small": "INFO", "staged-in-pool": "INFO", "not-in-pool": "WARNING"}, levels
    assert stats.to_msg()["fallbacks"] == {"small": 1, "staged-in-pool": 1, "not-in-pool": 1}


def test_timed_steps_add_up_count_total_and_longest():
    stats = HandoffStats()
    stats.timed("claim", 0.002)
    stats.timed("claim", 0.001)
    stats.timed("stage", 0.5)
    assert stats.to_msg()["timings"] == {
        # 1 ms and 2 ms fall in bins 39 and 43 (four per doubling from 1 µs: 4 * log2(1000) = 39.9)
        "claim": {"count": 2, "total_s": 0.003, "max_s": 0.002, "hist": {"39": 1, "43": 1}},
        "stage": {"count": 1, "total_s": 0.5, "max_s": 0.5, "hist": {"75": 1}},
    }


def test_a_timed_steps_quantiles_come_from_its_histogram_within_nine_percent():
    """The median and the tail of a step whose mean hides them: nine fast samples and one slow one."""
    stats = HandoffStats()
    for seconds in [20e-6] * 9 + [40e-3]:
        stats.timed("stage-alloc", seconds)
    hist = stats.to_msg()["timings"]["stage-alloc"]["hist"]
    assert abs(quantile_s(hist, 0.5) / 20e-6 - 1) < 0.09
    assert abs(quantile_s(hist, 1.0) / 40e-3 - 1) < 0.09
    assert quantile_s({}, 0.5) is None
    assert quantile_s({"0": 3}, 0.5) == 0.5e-6  # under 1 µs
    # what a later snapshot counts that an earlier one did not: the samples in between
    earlier = dict(hist)
    stats.timed("stage-alloc", 40e-3)
    later = stats.to_msg()["timings"]["stage-alloc"]["hist"]
    between = subtract_hist(later, earlier)
    assert sum(between.values()) == 1 and abs(quantile_s(between, 0.5) / 40e-3 - 1) < 0.09


def test_every_timed_step_is_explained_and_timed_somewhere():
    source = "".join(p.read_text() for p in PACKAGE.rglob("*.py"))
    timed = set(re.findall(r'\.timed\("([a-z-]+)"', source))
    assert timed == set(TIMED_STEPS)
