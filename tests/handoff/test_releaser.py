"""The importer's Releaser and HeldLeases without a cluster: the link factory is a plain recording object.

The links stand in for :class:`~dask_gpupool.transport.link.PeerLink` (the
transport is tested in ``test_broker.py`` and by every cluster test); what is
under test is the bookkeeping: batching, the live set and its epochs
(:class:`~dask_gpupool.handoff.held.HeldLeases`), what happens while a link is
down, and an exporter that left.
"""

from __future__ import annotations

import threading
import time

import pytest
from conftest import wait_for

from dask_gpupool.errors import PeerLostError
from dask_gpupool.handoff.held import HeldLeases
from dask_gpupool.handoff.imported import Releaser


class RecordingLink:
    """What the releaser calls on a link: ``release``, ``release_segments`` and ``settle_forwarded``; ``down`` makes
    them fail (``failed`` counts those calls)."""

    def __init__(self) -> None:
        self.released: list[list[int]] = []
        self.unmapped: list[list[int]] = []
        self.segments: list[list[tuple[int, int]]] = []
        self.settled: list[list[int]] = []
        self.down = False
        self.failed = 0

    def _check(self) -> None:
        if self.down:
            self.failed += 1
            raise PeerLostError("link down")

    def release(self, leases: list[int], unmapped: bool = False) -> None:
        self._check()
        (self.unmapped if unmapped else self.released).append(list(leases))

    def release_segments(self, segments: list[tuple[int, int]]) -> None:
        self._check()
        self.segments.append(list(segments))

    def settle_forwarded(self, leases: list[int]) -> None:
        self._check()
        self.settled.append(list(leases))


class Links:
    """The releaser's LinkFactory: one RecordingLink per exporter; ``None`` for an exporter that left. ``asked``
    lists the exporters asked for, in order."""

    def __init__(self) -> None:
        self.links: dict[str, RecordingLink] = {}
        self.left: set[str] = set()
        self.calls = 0
        self.asked: list[str] = []
        self.lock = threading.Lock()

    def __call__(self, exporter: str) -> RecordingLink | None:
        with self.lock:
            self.calls += 1
            self.asked.append(exporter)
            if exporter in self.left:
                return None
            return self.links.setdefault(exporter, RecordingLink())


class DoneEvent:
    """The GPU work a release waits for: already complete (``sync`` returns at once), and closed after."""

    def __init__(self) -> None:
        self.synced = self.closed = False

    def sync(self) -> None:
        self.synced = True

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def releaser():
    links = Links()
    r = Releaser(links, HeldLeases())
    yield r, links
    r.close()


def test_releases_leave_the_live_set_and_go_in_batches(releaser):
    r, links = releaser
    epoch = r.held.epoch("a")
    assert r.held.hold("a", [1, 2, 3], epoch=epoch) and r.held.live("a") == 3
    events = [DoneEvent() for _ in range(3)]
    for lease, event in zip((1, 2, 3), events, strict=True):
        r.put("a", lease, event)
    r.flush()
    assert r.held.live() == 0 and r.sent == 3
    assert sorted(x for batch in links.links["a"].released for x in batch) == [1, 2, 3]
    assert all(e.synced and e.closed for e in events)  # GPU work waited for before each release


def test_a_claim_that_raced_a_resync_snapshot_is_not_held(releaser):
    """A snapshot (the resync of a new link) bumps the epoch: a claim begun before must be made again."""
    r, _ = releaser
    epoch = r.held.epoch("a")
    assert r.held.hold("a", [1], epoch=epoch)
    assert r.held.snapshot("a")[0] == [1]
    assert not r.held.hold("a", [2], epoch=epoch)
    assert r.held.live("a") == 1 and r.held.hold("a", [2], epoch=r.held.epoch("a"))
    assert r.held.snapshot("a")[0] == [1, 2]


def test_releases_while_the_link_is_down_are_ended_by_the_resync_and_segments_sent_again(releaser):
    r, links = releaser
    link = links("a")
    assert link is not None
    r.held.hold("a", [7, 8], epoch=r.held.epoch("a"))
    link.down = True
    r.put("a", 7, None, ((3, 1),))
    r.flush()
    assert link.released == [] and r.held.live("a") == 1  # gone from the live set: the resync will end lease 7
    link.down = False
    for _ in range(100):  # the retry opens the link again (here: the same one) and resends the segment release
        if link.segments:
            break
        time.sleep(0.05)
    assert link.segments == [[(3, 1)]] and r.resyncs >= 1
    assert r.held.snapshot("a")[0] == [8]  # what a resync would send: lease 8 only


def test_an_exporter_that_left_takes_its_leases_with_it(releaser):
    r, links = releaser
    r.held.hold("gone", [5], epoch=r.held.epoch("gone"))
    links.left.add("gone")
    r.put("gone", 5)
    r.flush()
    assert r.held.live() == 0 and r.sent == 0  # nothing to send to a worker that left


def test_close_sends_what_is_queued(releaser):
    r, links = releaser
    r.held.hold("a", [1], epoch=r.held.epoch("a"))
    r.put("a", 1)
    r.close()
    assert links.links["a"].released == [[1]]


def test_a_lease_held_by_its_reply_is_held_at_once_unless_refused_or_a_resync_is_open(releaser):
    """Leases claimed by the reply, the importer's side. Answering an exporter's query refuses, for good and at the
    same moment, the leases not held; while a resync is open nothing is held here (the broker claims instead)."""
    r, links = releaser
    assert r.held.hold_here("a", 1) is True and r.held.live("a") == 1
    # the exporter's reply failed: it asks; 1 is held, 2 (not deserialized yet) is refused from now on
    assert r.answer("a", [1, 2]) == [1]
    assert r.held.hold_here("a", 2) is False and r.held.live("a") == 1
    assert r.held.hold_here("b", 2) is True  # refusals are per exporter
    # a resync of "a" is open: the caller claims over the broker
    live, epoch = r.held.snapshot("a")
    assert live == [1] and r.held.hold_here("a", 3) is None
    r.held.resynced("a", epoch - 1)  # an older snapshot's answer does not count
    assert r.held.hold_here("a", 3) is None
    r.held.resynced("a", epoch)
    assert r.held.hold_here("a", 3) is True and r.held.live("a") == 2
    # a lease held and released since counts as held: its release ends it at the exporter, which must not take
    # its segment's claim back (counted here) as for a lease never held; and the release goes again, in case the
    # exporter counts it claimed only from this answer on
    r.put("a", 3)
    r.flush()
    assert r.held.live("a") == 1 and r.answer("a", [3]) == [3]
    r.flush()
    assert [x for batch in links.links["a"].released for x in batch].count(3) == 2
    # a lease never mapped here (its import failed) is released as such, and answered as not held
    assert r.held.hold_here("a", 4) is True
    r.put("a", 4, unmapped=True)
    r.flush()
    assert links.links["a"].unmapped == [[4]] and r.answer("a", [4]) == []
    # an exporter that left: its refusals go with it
    r.forget("a")
    assert r.held.hold_here("a", 2) is True


def test_resyncs_open_on_two_threads_and_a_failed_one_close_only_with_a_newer_answer(releaser):
    """Two links opened at once, or a resync whose answer never came (the exporter may read it late): nothing is
    held here until a resync at least as new as every open one was answered (the exporter ignores older ones)."""
    r, _ = releaser
    _, e1 = r.held.snapshot("a")
    _, e2 = r.held.snapshot("a")
    r.held.resynced("a", e1)
    assert r.held.hold_here("a", 1) is None  # e2 is still open
    r.held.resynced("a", e2)
    assert r.held.hold_here("a", 1) is True
    _, e3 = r.held.snapshot("a")  # failed: never answered
    assert r.held.hold_here("a", 2) is None
    _, e4 = r.held.snapshot("a")
    r.held.resynced("a", e4)  # a newer one answered: e3, if read later, is ignored by the exporter
    assert e3 < e4 and r.held.hold_here("a", 2) is True


def test_refusals_are_bounded_per_exporter(releaser, monkeypatch):
    from dask_gpupool.handoff import held as module

    monkeypatch.setattr(module, "REFUSED_KEPT", 3)
    r, _ = releaser
    assert r.answer("a", [1, 2, 3, 4, 5]) == []
    assert [r.held.hold_here("a", i) for i in (1, 2, 3, 4, 5)] == [True, True, False, False, False]


def test_releases_while_the_link_is_down_go_again_after_the_resync(releaser):
    """A resync ends only leases the exporter counts claimed by then; one it counts claimed later (a query's answer)
    must still be released, so the releases queued while the link was down are sent once it is back."""
    r, links = releaser
    assert r.held.hold_here("a", 7) is True and r.held.hold_here("a", 8) is True and r.held.hold_here("a", 9) is True
    r.put("a", 8)
    r.flush()
    links.links["a"].down = True
    r.put("a", 7)
    r.put("a", 9, unmapped=True)
    r.flush()
    # a lease never mapped stays live (in a resync's snapshot) until its release went: a resync without it would
    # end it at the exporter without taking its segment claim back
    assert r.held.live("a") == 1 and r.held.snapshot("a")[0] == [9]
    links.links["a"].down = False
    deadline = time.monotonic() + 10
    while not links.links["a"].unmapped and time.monotonic() < deadline:
        time.sleep(0.02)
    assert [7] in links.links["a"].released and links.links["a"].unmapped == [[9]] and r.held.live("a") == 0


def test_refusals_in_all_are_bounded_and_the_least_recently_asked_exporter_loses_them_first(releaser, monkeypatch):
    from dask_gpupool.handoff import held as module

    monkeypatch.setattr(module, "REFUSED_KEPT", 2)
    r, _ = releaser
    assert r.answer("a", [1]) == [] and r.answer("b", [1]) == []
    assert r.answer("a", [2]) == []  # "a" asked again: "b" is now the least recently asked
    assert r.held.hold_here("b", 1) is True
    assert r.held.hold_here("a", 1) is False and r.held.hold_here("a", 2) is False


def test_queries_that_refuse_nothing_keep_nothing_and_exporters_kept_are_bounded(releaser, monkeypatch):
    from dask_gpupool.handoff import held as module

    monkeypatch.setattr(module, "REFUSED_EXPORTERS", 2)
    r, _ = releaser
    for i in range(100):
        assert r.answer(f"made-up-{i}", []) == []  # nothing refused: nothing kept
    assert r.held.hold_here("a", 1) is True and r.answer("a", [1, 2]) == [1]
    r.answer("b", [3])
    r.answer("c", [4])  # a third exporter: the least recently asked ("a") goes whole
    assert r.held.hold_here("a", 2) is True
    assert r.held.hold_here("b", 3) is False and r.held.hold_here("c", 4) is False


def test_a_forward_settle_that_could_not_be_sent_goes_once_the_link_is_back(releaser):
    """``settle_later``: the forwarder could not send a ForwardSettle when its reply ended; the releaser sends it
    once a link to that exporter opens again (with backoff), and drops it if the exporter left."""
    r, links = releaser
    link = links("a")
    assert link is not None
    link.down = True
    r.settle_later("a", [11, 12])
    wait_for(lambda: link.failed >= 2, what="a few retries, all failed")
    assert link.settled == []
    link.down = False
    deadline = time.monotonic() + 10
    while not link.settled and time.monotonic() < deadline:
        time.sleep(0.02)
    assert link.settled == [[11, 12]]
    links.left.add("gone")
    r.settle_later("gone", [13])
    r.flush()
    wait_for(lambda: "gone" in links.asked, what="the retry to ask for a link to the exporter that left")
    assert "gone" not in links.links  # no link to an exporter that left, nothing kept for it


def test_a_lease_is_imported_once_from_its_begin_through_its_release(releaser):
    """``begin`` admits a lease once: while its import is open (claimed or not), held, or after it was released, a
    header naming it again (a replay) is refused; an import that failed before holding anything gives it back."""
    r, links = releaser
    assert r.held.begin("a", 1) and not r.held.begin("a", 1)  # open, not claimed yet
    assert r.held.begin("b", 1)  # another exporter's lease 1 is another lease
    assert r.held.hold("a", [1], epoch=r.held.epoch("a")) and not r.held.begin("a", 1)  # claimed
    r.put("a", 1)  # the import closed: live until its release is handled
    assert not r.held.begin("a", 1)
    r.flush()
    assert links.links["a"].released == [[1]] and r.held.live("a") == 0
    assert not r.held.begin("a", 1)  # released: a later header naming it is a replay
    assert r.held.begin("a", 2)
    r.held.end_import("a", 2)  # failed before it held anything (a refused claim, no link)
    assert r.held.begin("a", 2)


def test_a_lease_whose_claim_failed_on_a_broken_link_stays_refused_until_its_release_is_settled(releaser):
    """A claim written on a link that then broke may have reached the exporter, which counts the lease claimed; the
    import fails (``DataLostError``) and its buffer's close queues the release, which waits for the link. A header
    naming that lease again meanwhile (a replay) was admitted: the lease was neither importing (the release was
    queued), nor live (the claim was never acknowledged), nor released (only held leases were kept). Its claim was
    answered as held (the exporter counts it claimed), and the first import's release, sent once the link was back,
    ended the lease the replay maps. A lease id now stays refused until its release went to the exporter, and after
    that as released ones are (bounded)."""
    r, links = releaser
    link = links("a")
    assert link is not None
    assert r.held.begin("a", 1)  # the first import: mapped, its claim over the broker
    link.down = True  # the claim reached the exporter, its answer did not: never held here
    r.put("a", 1)  # the failed claim closed the buffer: its release is queued, and waits for the link
    r.held.end_import("a", 1)  # then the import raised (a claim run at once; a deferred one raises after it returned)
    r.flush()
    assert link.released == []
    replay = r.held.begin("a", 1)  # the header again, while that release is pending
    if replay:  # what the importer does next: claim it, which the exporter answers as held (claimed already)
        assert r.held.hold("a", [1], epoch=r.held.epoch("a"))
    link.down = False
    deadline = time.monotonic() + 10
    while not link.released and time.monotonic() < deadline:
        time.sleep(0.02)
    assert link.released == [[1]]  # the first import's release: the lease ended at the exporter
    assert not (replay and r.held.holds("a", 1)), "the exporter ended the lease that the replayed import maps"
    assert not replay, "a replay was admitted while the first import's release was pending"
    assert not r.held.begin("a", 1)  # settled: still refused here (kept with the released ones, bounded)


def test_ended_leases_are_remembered_within_the_bound_and_forgotten_with_their_exporter(releaser, monkeypatch):
    """Leases released without being held here (failed claims) are refused once settled as released ones are: the
    last :data:`REFUSED_KEPT` per exporter, and none once the exporter left."""
    from dask_gpupool.handoff import held as module

    monkeypatch.setattr(module, "REFUSED_KEPT", 2)
    r, links = releaser
    for lease in (1, 2, 3):
        assert r.held.begin("a", lease)
        r.put("a", lease)  # never held here
    r.flush()
    assert links.links["a"].released == [[1, 2, 3]]
    assert r.held.begin("a", 1)  # the oldest was forgotten: two are kept
    assert not r.held.begin("a", 2) and not r.held.begin("a", 3)
    r.forget("a")
    assert r.held.begin("a", 2) and r.held.begin("a", 3)


def test_a_lease_whose_release_waits_for_a_broken_link_stays_refused_and_one_of_an_exporter_that_left_is_dropped(
    releaser,
):
    """The two ways a release stays queued: its link is down (the release is retried, the lease refused until it was
    written, and after that as an ended one), or the exporter left meanwhile (nothing is sent, nothing of it kept)."""
    r, links = releaser
    link = links("a")
    assert link is not None
    assert r.held.begin("a", 1) and r.held.begin("a", 2)
    link.down = True
    r.put("a", 1)  # never held here (a failed claim)
    r.held.end_import("a", 1)
    r.put("a", 2)
    r.flush()
    wait_for(lambda: link.failed >= 2, what="a few retries, all failed")
    assert link.released == [] and not r.held.begin("a", 1) and not r.held.begin("a", 2)
    link.down = False
    deadline = time.monotonic() + 10
    while not link.released and time.monotonic() < deadline:
        time.sleep(0.02)
    assert sorted(x for batch in link.released for x in batch) == [1, 2]
    assert not r.held.begin("a", 1) and not r.held.begin("a", 2)  # written: ended, still refused
    gone = links("gone")
    assert gone is not None and r.held.begin("gone", 3)
    gone.down = True
    r.put("gone", 3)
    r.flush()
    assert not r.held.begin("gone", 3)  # waiting for the link
    links.left.add("gone")
    deadline = time.monotonic() + 10
    while not r.held.begin("gone", 3) and time.monotonic() < deadline:  # the retry finds it left: forgotten
        time.sleep(0.02)
    assert gone.released == [] and r.held.live() == 0


def test_an_unexpected_error_while_releasing_is_retried_and_the_releaser_keeps_serving(releaser):
    """A link that raises something other than a :class:`GPUPoolError` (a fault of ours: the link turns ``OSError``
    into ``PeerLostError``) must not end the releaser's thread: every later release would then stay queued, and the
    exporter would keep that memory until this worker's process exits. The failed release is sent again, as after a
    broken link, and later ones go as usual."""
    r, links = releaser
    link = links("a")
    assert link is not None
    failures = [RuntimeError("a fault of ours")]
    release = link.release

    def failing_once(leases: list[int], unmapped: bool = False) -> None:
        if failures:
            raise failures.pop()
        release(leases, unmapped)

    link.release = failing_once
    r.held.hold("a", [1, 2], epoch=r.held.epoch("a"))
    r.put("a", 1)
    r.flush(timeout=2)
    r.put("a", 2)
    deadline = time.monotonic() + 10
    while sorted(x for batch in link.released for x in batch) != [1, 2] and time.monotonic() < deadline:
        r.flush(timeout=0.5)
        time.sleep(0.05)
    assert sorted(x for batch in link.released for x in batch) == [1, 2], "the releaser's thread died"
    assert r.held.live("a") == 0
