"""The retire protocol's ledger: which peers may still map a segment, by the leases they claimed.

A segment is never freed while a peer may map it: reading a peer's memory
after its owner freed it breaks the reader's CUDA context
(``CUDA_ERROR_CONTAINED`` across GPUs). :meth:`SegmentedResource.retire
<dask_gpupool.memory.segments.SegmentedResource.retire>` starts the protocol:

1. Every segment existing now is marked retiring (ids below ``retire_below``);
   new buffers go to new segments. A full
   pool also retires single spare segments of large buffers that peers map
   (ids in ``reclaim``).
2. The pool service publishes ``retire_below`` (and ``reclaim``) in its registry row. A peer
   that maps a retiring segment unmaps it as soon as no buffer it imported
   from it is alive, then sends a ``SegmentRelease`` naming the segment and
   how many leases on it it had claimed in all.
3. Here (:class:`RetireLedger`) a segment counts as mapped by a peer while the
   leases claimed on it by that peer (worker) outnumber those the peer's last
   release accounted for (a release that crosses a newer claim does not
   count), and stops being mapped when the peer's process exits.
4. A retiring segment with no live buffer and no mapping peer is freed.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable

__all__ = ["RetireLedger"]


class RetireLedger:
    """Per segment id and peer: leases claimed, and the claim count the peer's last release accounted for.

    A plain record with no lock of its own: its owner (the
    :class:`~dask_gpupool.memory.segments.SegmentedResource`) calls it under
    its lock. Peers are named by any hashable (the importer's worker address).
    """

    __slots__ = ("_claims", "_released")

    def __init__(self) -> None:
        self._claims: dict[int, dict[Hashable, int]] = {}
        self._released: dict[int, dict[Hashable, int]] = {}

    def claimed(self, segment_ids: Iterable[int], peer: Hashable) -> None:
        """``peer`` claimed one lease on a buffer in each of ``segment_ids`` (an id per lease)."""
        for seg in segment_ids:
            claims = self._claims.setdefault(seg, {})
            claims[peer] = claims.get(peer, 0) + 1

    def unclaimed(self, segment_ids: Iterable[int], peer: Hashable) -> None:
        """Take back one claim of ``peer`` on each of ``segment_ids``: a lease noted at its grant ended unheld."""
        for seg in segment_ids:
            claims = self._claims.get(seg)
            if claims is None or peer not in claims:
                continue
            claims[peer] -= 1
            if claims[peer] <= 0:
                del claims[peer]
                self._released.get(seg, {}).pop(peer, None)
                if not claims:
                    del self._claims[seg]
                    self._released.pop(seg, None)

    def released(self, releases: Iterable[tuple[int, int]], peer: Hashable) -> None:
        """``peer`` unmapped segments: ``(segment id, leases it had claimed on it in all)`` pairs.

        A release for a segment the peer never claimed on is ignored.
        """
        for seg, claimed in releases:
            if peer in self._claims.get(seg, ()):
                self._released.setdefault(seg, {})[peer] = claimed

    def drop_peer(self, peer: Hashable) -> None:
        """``peer`` is gone (its process exited, or it left the registry and cannot be watched): it maps nothing
        any more."""
        for table in (self._claims, self._released):
            for seg in [s for s, peers in table.items() if peers.pop(peer, None) is not None and not peers]:
                del table[seg]

    def mapped(self, segment_id: int) -> bool:
        """Whether a peer may still map segment ``segment_id``."""
        released = self._released.get(segment_id, {})
        return any(n != released.get(p, 0) for p, n in self._claims.get(segment_id, {}).items())

    def forget(self, segment_id: int) -> None:
        """Segment ``segment_id`` was freed: drop its records."""
        self._claims.pop(segment_id, None)
        self._released.pop(segment_id, None)

    def peers(self, segment_id: int) -> dict[Hashable, tuple[int, int]]:
        """``{peer: (claimed, accounted for by its last release)}`` for one segment (for stats and tests)."""
        released = self._released.get(segment_id, {})
        return {p: (n, released.get(p, 0)) for p, n in self._claims.get(segment_id, {}).items()}
