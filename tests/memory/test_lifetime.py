"""Memory kept past its owner's use: the quarantine of memory a peer's UCX transfer may still reach (CPU).

The owners here are plain Python objects: the quarantine only keeps references to them (what a staging block, a
pool buffer or a receive-pool block does with its memory once let go is not its business). The processes are real
ones, watched by pidfd."""

from __future__ import annotations

import gc
import logging
import os
import subprocess
import sys
import weakref

from dask_gpupool.memory.lifetime import Quarantine


class Owner:
    """What a frame keeps alive: ``nbytes`` of memory that its collection would give back."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])


def _open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def test_parked_memory_is_kept_until_the_watched_process_exits_and_its_pidfd_is_closed(caplog):
    """Owners parked for a live process stay alive (counted in ``count`` and ``nbytes``) until that process exits;
    then the next look (any of ``sweep``, ``count``, ``nbytes``, ``park``) lets them go and closes the pidfd. Logged
    once per quarantine, at WARNING, naming what was parked and why."""
    quarantine = Quarantine()
    fds = _open_fds()
    child = _sleeper()
    try:
        owners = [Owner(1 << 20), Owner(3 << 20)]
        refs = [weakref.ref(o) for o in owners]
        with caplog.at_level(logging.WARNING, logger="dask_gpupool.memory.lifetime"):
            assert quarantine.park(owners, child.pid, "a reply to w1 that ended without its OK")
            assert quarantine.park([Owner(5)], child.pid, "another")
        del owners
        gc.collect()
        assert all(r() is not None for r in refs)
        assert (quarantine.count, quarantine.nbytes) == (3, (4 << 20) + 5)
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and "a reply to w1 that ended without its OK" in warnings[0].getMessage()
        assert str(child.pid) in warnings[0].getMessage()
    finally:
        child.kill()
        child.wait()
    assert quarantine.sweep() == 3
    gc.collect()
    assert all(r() is None for r in refs)
    assert (quarantine.count, quarantine.nbytes) == (0, 0)
    assert _open_fds() <= fds, "the pidfd of the exited process is closed"


def test_memory_of_a_process_that_cannot_be_watched_is_kept_for_this_processs_life():
    """No pid (another host, a requester without a registry row), or this process's own pid (a requester in this
    process: an in-process cluster), cannot be watched: the owners are kept whatever happens later."""
    quarantine = Quarantine()
    kept = [Owner(10), Owner(20)]
    refs = [weakref.ref(o) for o in kept]
    assert quarantine.park(kept[:1], None, "a read that did not complete")
    assert quarantine.park(kept[1:], os.getpid(), "a reply to a worker of this process")
    del kept
    quarantine.sweep()
    gc.collect()
    assert all(r() is not None for r in refs)
    assert (quarantine.count, quarantine.nbytes) == (2, 30)


def test_memory_of_a_process_gone_already_is_not_kept():
    """A process that exited before its memory is parked reads nothing any more: nothing is kept, nothing counted."""
    quarantine = Quarantine()
    child = _sleeper()
    child.kill()
    child.wait()
    owner = Owner(7)
    ref = weakref.ref(owner)
    assert not quarantine.park([owner], child.pid, "a reply to a worker that died")
    del owner
    gc.collect()
    assert ref() is None
    assert (quarantine.count, quarantine.nbytes) == (0, 0)
    assert not quarantine.park([], None, "nothing")  # nothing to park
