"""Pulled copies land through vkgdr where it runs, through pinned staging (said once) where it does not.

The vkgdr path itself needs a GPU with NVIDIA's Vulkan driver:
``tests/transport/test_device_copies.py::test_handoff_copies_across_host_ids_on_gpus``.
"""

from __future__ import annotations

import importlib.util
import logging

import pytest

from dask_gpupool.transport import pull as pull_module
from dask_gpupool.transport.vkgdr_staging import VkgdrStaging


@pytest.mark.skipif(importlib.util.find_spec("vkgdr") is not None, reason="vkgdr is installed here")
def test_without_vkgdr_the_reason_is_said_and_remembered():
    staging = VkgdrStaging()
    why = staging.unavailable(0)
    assert why is not None and "vkgdr" in why
    assert staging.unavailable(0) == why  # remembered: the import is not tried again
    with pytest.raises(RuntimeError, match="vkgdr"):
        staging.take(0, 1 << 20)
    assert staging.nbytes == 0
    staging.clear()  # nothing kept, nothing to free


@pytest.mark.skipif(importlib.util.find_spec("vkgdr") is not None, reason="vkgdr is installed here")
def test_a_pull_where_vkgdr_cannot_run_lands_through_pinned_staging_and_says_so_once(monkeypatch, caplog):
    monkeypatch.setattr(pull_module, "VKGDR", VkgdrStaging())
    monkeypatch.setattr(pull_module, "_VKGDR_REFUSED", set())
    with caplog.at_level(logging.INFO, logger=pull_module.__name__):
        assert pull_module._vkgdr_slots(0, 1 << 20) is None
        assert pull_module._vkgdr_slots(0, 1 << 20) is None
    said = [r for r in caplog.records if "vkgdr cannot land copies" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.INFO
    assert "pinned staging is used instead" in said[0].getMessage()


def test_kept_slot_sets_are_reused_up_to_keep_and_freed_after():
    """The bookkeeping pinned staging and vkgdr slots share (``KeptSlots``), with slots that record their freeing."""
    from dask_gpupool.transport.staging import SLOTS, KeptSlots

    freed: list[int] = []

    class Slots(KeptSlots[int]):
        def take(self, device: int, chunk: int) -> list[int]:
            return self._kept(device, chunk) or [chunk] * SLOTS

        def _free_slot(self, slot: int) -> None:
            freed.append(slot)

        def _slot_size(self, slot: int) -> int:
            return slot

    kept = Slots(keep=1)
    a, b = kept.take(0, 8), kept.take(0, 8)
    kept.give(0, 8, a)
    kept.give(0, 8, b)  # one set kept per (GPU, chunk): the second is freed
    assert freed == [8] * SLOTS and kept.nbytes == 8 * SLOTS
    assert kept.take(0, 8) is a and kept.nbytes == 0  # reused
    assert kept.take(1, 8) is not a  # another GPU's set is its own
    kept.give(0, 8, a)
    kept.clear()
    assert freed == [8] * (2 * SLOTS) and kept.nbytes == 0
