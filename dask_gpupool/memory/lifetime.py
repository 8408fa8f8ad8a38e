"""Memory that must outlive its owner's use of it: kept, never freed, until the process exits.

Below both :mod:`dask_gpupool.memory.pool` and :mod:`dask_gpupool.memory.segments`,
which hand closed memory here.
"""

from __future__ import annotations

from typing import Any

__all__ = ["KEPT_UNTIL_EXIT", "keep_until_exit"]


#: Memory of closed CUDA pools that peers may still map: kept, never freed, until the process exits.
KEPT_UNTIL_EXIT: list[Any] = []


def keep_until_exit(items: Any) -> int:
    """Keep ``items`` (Buffers, or objects holding them) alive until the process exits; return how many.

    Freeing memory that a peer still maps is undefined (same GPU: the peer
    reads what comes next; other GPU: CUDA_ERROR_CONTAINED). The driver keeps
    importers' mappings valid past the exporter's *exit*, so a closing CUDA
    pool hands what peers may map here instead of freeing it.
    """
    before = len(KEPT_UNTIL_EXIT)
    KEPT_UNTIL_EXIT.extend(items)
    return len(KEPT_UNTIL_EXIT) - before
