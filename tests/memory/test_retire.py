"""The retire protocol's ledger (:class:`dask_gpupool.memory.retire.RetireLedger`), without CUDA or a cluster."""

from __future__ import annotations

from dask_gpupool.memory.retire import RetireLedger


def test_a_segment_is_mapped_from_the_first_claim_until_a_release_accounts_for_every_claim():
    ledger = RetireLedger()
    assert not ledger.mapped(1)
    ledger.claimed([1, 1, 2], "tcp://b:1")  # two leases in segment 1, one in 2
    assert ledger.mapped(1) and ledger.mapped(2)
    ledger.released([(1, 2)], "tcp://b:1")
    assert not ledger.mapped(1) and ledger.mapped(2)
    assert ledger.peers(1) == {"tcp://b:1": (2, 2)}


def test_a_release_that_crossed_a_newer_claim_leaves_the_segment_mapped():
    """The peer released after 1 claim while a second claim was on its way: it maps the segment again."""
    ledger = RetireLedger()
    ledger.claimed([7], "b")
    ledger.claimed([7], "b")
    ledger.released([(7, 1)], "b")
    assert ledger.mapped(7)
    ledger.released([(7, 2)], "b")
    assert not ledger.mapped(7)


def test_each_peer_counts_on_its_own():
    ledger = RetireLedger()
    ledger.claimed([3], "b")
    ledger.claimed([3], "c")
    ledger.released([(3, 1)], "b")
    assert ledger.mapped(3)  # c still maps it
    ledger.released([(3, 1)], "c")
    assert not ledger.mapped(3)


def test_a_release_from_a_peer_that_never_claimed_is_ignored():
    """A peer cannot make a segment unmapped for another, nor record releases ahead of claims."""
    ledger = RetireLedger()
    ledger.claimed([4], "b")
    ledger.released([(4, 1)], "intruder")
    ledger.released([(5, 3)], "b")  # no claim on 5
    assert ledger.mapped(4) and ledger.peers(4) == {"b": (1, 0)}
    ledger.claimed([5], "b")
    assert ledger.mapped(5)  # the early release did not pre-pay this claim


def test_a_peer_that_left_maps_nothing_and_leaves_no_records():
    ledger = RetireLedger()
    ledger.claimed([1, 2], "b")
    ledger.claimed([2], "c")
    ledger.released([(1, 1)], "b")
    ledger.drop_peer("b")
    assert not ledger.mapped(1) and ledger.mapped(2)
    assert ledger.peers(1) == {} and ledger.peers(2) == {"c": (1, 0)}
    ledger.drop_peer("c")
    assert not ledger._claims and not ledger._released


def test_a_freed_segment_is_forgotten():
    ledger = RetireLedger()
    ledger.claimed([9], "b")
    ledger.forget(9)
    assert not ledger.mapped(9) and ledger.peers(9) == {}
