"""Handoff counters of one worker, and the one-warning-per-(peer, reason) rule."""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Mapping
from typing import Any

__all__ = [
    "EXPECTED_REASONS",
    "FALLBACK_ADVICE",
    "FALLBACK_REASONS",
    "TIMED_STEPS",
    "HandoffStats",
    "quantile_s",
    "subtract_hist",
]

#: Histogram bins per doubling of a timed step's duration: a quantile read from them is within 9% of the sample's.
BINS_PER_OCTAVE = 4

logger = logging.getLogger("dask_gpupool")

#: Why a same-host transfer was copied instead of handed over, as counted in ``fallbacks``.
FALLBACK_REASONS = {
    "same-process": "the requester is this process",
    "comm": "the comm is not TCP, TLS or UCX (inproc, websockets): the value goes in the comm's frames",
    "not-in-pool": "the value does not live in this worker's pool",
    "no-access": "the requester cannot reach the memory (GPU not visible, or no GPU)",
    "other-gpu": "the requester works on another GPU, which has no peer access to this pool's GPU",
    "pool-closed": "this worker's pool is closing",
    "import-failed": "the requester could not import the descriptor and fetched a copy",
    "retired-segment": (
        "the value lies in a segment its exporter retired (trim, reclaim) that the requester had already unmapped "
        "and released: it fetched a copy rather than map the segment again"
    ),
    "receiver-pool-full": "the receiver's pool was full; the copy went to memory outside it",
    "pool-full": "this worker's pool had no room to stage the array: it went in the comm's frames, as Dask sends it",
    "peer-share": (
        "the requester's live leases already held half of this worker's pool (what one peer may pin): the value "
        "went as a copy"
    ),
    "unknown-requester": (
        "the requester, at this host's address, has no pool in this worker's registry view "
        "(its gpupool set-up failed, or its row has not arrived yet)"
    ),
    "unbound-comm": (
        "the request named a worker of this host on a comm not bound to it (its bind was refused or broke off, or "
        "the process that asked is not that worker): the reply is Dask's own"
    ),
    "peer-unreachable": (
        "a recent transfer to this peer failed (its link could not be opened, or its claim never came): "
        "it gets copies for gpupool.lease-timeout"
    ),
    "forward-refused": (
        "a value this worker imported could not be passed on as its exporter's memory: the exporter refused "
        "the forwarded lease or could not be reached"
    ),
    "staged-in-pool": (
        "the array lived outside this worker's pool: it was copied into the pool here (device to device for "
        "CuPy) and then handed over, instead of going through the comm"
    ),
    "pickled": (
        "the value is an object Dask pickles (none of gpupool's serializers knows its type): the arrays in it, "
        "pool memory or not, go in the comm's frames"
    ),
    "structured-dtype": (
        "the value is a pool array of a structured dtype, which an array header cannot describe (its dtype.str "
        "loses the fields): it goes through Dask's own serializer, in the comm's frames"
    ),
    "small": (
        "the value is small: an array outside this worker's pool below the stage threshold, or a pool buffer "
        "below the handoff threshold (dask_gpupool.tuning); the comm moves it as fast as staging or a handoff would"
    ),
}


#: What to change so that a fallback of each reason becomes a zero-copy handoff (said in its one WARNING).
FALLBACK_ADVICE = {
    "same-process": "nothing: values within one process are not copied by Dask anyway",
    "comm": "use a tcp://, tls:// or ucx(x):// comm between same-host workers for zero-copy handoffs",
    "not-in-pool": ("make the result in the pool: dask_gpupool.allocate + as_array, or dask_gpupool.to_pool(result)"),
    "no-access": "make the producer's GPU visible to the consumer (CUDA_VISIBLE_DEVICES), or accept copies",
    "other-gpu": "put producer and consumer on one GPU, or on GPUs with peer access to each other (NVLink, PCIe P2P)",
    "pool-closed": "nothing: the worker is closing",
    "import-failed": "see the consumer's log for the import error",
    "retired-segment": "nothing for new values (they go to new segments); values made before a trim() are copied",
    "receiver-pool-full": "raise the receiver's gpupool.max-size, or free its buffers sooner",
    "pool-full": "raise this worker's gpupool.max-size, or let its peers release what they hold sooner",
    "peer-share": "raise this worker's gpupool.max-size, or release the requester's results sooner",
    "unknown-requester": "see that worker's entry in dask_gpupool.stats(client): its pool set-up may have failed",
    "unbound-comm": "see the requester's log for why its comm was not bound (gpupool: a comm to ... is not bound)",
    "peer-unreachable": "see both workers' logs: the peer's broker or copy server could not be reached",
    "forward-refused": "see this worker's log for the exporter's answer (it may have left)",
    "staged-in-pool": ("make the result in the pool to skip the copy: dask_gpupool.allocate + as_array, or to_pool"),
    "pickled": (
        "return the arrays themselves, or a tuple, list or dict of them (Dask serializes those one by one), or "
        "register a Dask serializer for the type"
    ),
    "structured-dtype": (
        "hand over a plain-dtype view (arr.view(np.uint8)) or one array per field, and rebuild the records in the "
        "consumer"
    ),
    "small": "nothing: the comm is the faster path at this size",
}


#: Reasons that name the best path there is for the value (nothing to change): logged once per peer at INFO, not
#: WARNING. The rest say what to change in their one WARNING.
EXPECTED_REASONS = frozenset({"same-process", "staged-in-pool", "small"})


#: The steps :attr:`HandoffStats.timings` times (``stats()[worker]["timings"]``): where a handoff's time goes.
TIMED_STEPS = {
    "reply": "the producer's whole get_data reply, from the request to the consumer's OK (serializing, the comm's "
    "write, and for handoffs the consumer's import and claim)",
    "stage": "copying an array outside the pool into it: allocation and queuing the copy (its wait is in export)",
    "stage-alloc": "the part of stage or stage-after-task spent in the pool's allocation",
    "stage-after-task": "as stage, for a task result of this worker: the copy waits on a stream of its own for the "
    "event recorded when the result was stored, not for the kernels queued since",
    "export": "describing a pool buffer and waiting for the GPU work that wrote it (a staged copy's stream, or the "
    "whole GPU), then granting its lease",
    "export-task-wait": "the part of export spent waiting for the event recorded when the task result it hands "
    "over was stored (gpupool.handoff-ordering: sync), in place of synchronizing the whole GPU",
    "import": "the consumer's side of a handoff: mapping the buffer (the peer's pool or segment, once), without "
    "its claim",
    "device-stage": "copying pool memory into memory UCX can export before it goes as device frames (another "
    "host over UCX): the allocation (or a kept one) and the copy (waited for only where the comm does not "
    "synchronize the GPU before it sends: distributed-ucxx does)",
    "device-stage-alloc": "the part of device-stage spent allocating new staging memory (counted only then: a "
    "new allocation also costs the receiver a new cuda_ipc mapping)",
    "device-serialize": "the header and device frame of a staged value, in distributed's format (after device-stage)",
    "claim": "the claim round trip to the exporter's broker, once per exporter for a message's values: for forwarded "
    "values, and while a resync with that exporter is open (the others are claimed by the reply)",
}


class HandoffStats:
    """Counters of one worker's handoffs. Thread-safe.

    Attributes
    ----------
    exports, imports : int
        Buffers sent as IPC descriptors / mapped from peers.
    forwards : int
        Imported buffers passed on as their exporter's descriptor: the next
        worker maps the exporter's memory under a lease of its own.
    returns : int
        Values of this worker's pool that came back from a peer that had
        imported them: taken as the pool buffer itself, nothing mapped or copied.
    zero_copy_bytes : int
        Bytes this worker received by mapping a peer's memory (or, counted in
        ``returns``, got back as its own).
    copied_bytes : int
        Bytes this worker received as host copies (any sender).
    copied_out_bytes : int
        Bytes this worker sent as host copies (peers, clients, spilling).
    streamed_bytes, streamed_out_bytes : int
        The part of ``copied_bytes`` / ``copied_out_bytes`` that went over the
        pipelined copy path (:mod:`dask_gpupool.transport.stream`) rather than in Dask's frames.
    device_frames_bytes, device_frames_out_bytes : int
        Bytes of ``Buffer`` values and CuPy arrays received / sent as device
        frames (UCX comms: the comm moves them GPU to GPU; not zero-copy, not
        a host copy).
    device_staged_bytes : int
        The part of ``device_frames_out_bytes`` that was pool memory, copied
        device to device into memory UCX can send through ``cuda_ipc`` first.
    host_frames_bytes, host_frames_out_bytes : int
        Bytes of CuPy arrays and pool Buffers received / sent over UCX as one host frame
        instead of a device frame (below :data:`~dask_gpupool.tuning.UCX_HOST_FRAME_THRESHOLD`,
        where UCX's eager protocol bounces device memory through the host
        itself); not counted in ``copied_bytes``.
    receive_pooled_bytes, receive_pool_misses : int
        Device frames distributed-ucxx received into the UCX receive pool
        (bytes), and frames that did not fit under its ceiling and came from
        RMM's resource (count; :mod:`dask_gpupool.dask.ucx_receive`).
    pool_staged_bytes : int
        Arrays outside the pool copied into it on this worker (device to
        device for CuPy) and then handed over to a same-host worker
        (:func:`~dask_gpupool.handoff.routes.stage_threshold_of`; fallback ``staged-in-pool``).
    fallbacks : dict of str to int
        Same-host transfers that were copied, by reason (see :data:`FALLBACK_REASONS`).
    timings : dict of str to list
        Where a handoff's time goes, by step (see :data:`TIMED_STEPS`):
        ``[count, total seconds, longest seconds, histogram]``; the histogram
        counts durations by bin (:func:`_bin`: :data:`BINS_PER_OCTAVE` bins
        per doubling from 1 µs), so that a step's median and tail show
        (:func:`quantile_s`), not only its mean.
    """

    exports: int
    imports: int
    forwards: int
    returns: int
    zero_copy_bytes: int
    copied_bytes: int
    copied_out_bytes: int
    streamed_bytes: int
    streamed_out_bytes: int
    device_frames_bytes: int
    device_frames_out_bytes: int
    device_staged_bytes: int
    host_frames_bytes: int
    host_frames_out_bytes: int
    pool_staged_bytes: int
    receive_pooled_bytes: int
    receive_pool_misses: int
    fallbacks: dict[str, int]
    timings: dict[str, list[Any]]
    _warned: set[tuple[str, str]]
    _lock: threading.Lock

    def __init__(self) -> None:
        self.exports = self.imports = self.forwards = self.returns = 0
        self.zero_copy_bytes = self.copied_bytes = self.copied_out_bytes = 0
        self.streamed_bytes = self.streamed_out_bytes = 0
        self.device_frames_bytes = self.device_frames_out_bytes = self.device_staged_bytes = 0
        self.host_frames_bytes = self.host_frames_out_bytes = 0
        self.pool_staged_bytes = 0
        self.receive_pooled_bytes = self.receive_pool_misses = 0
        self.fallbacks = {}
        self.timings = {}
        self._warned = set()
        self._lock = threading.Lock()

    def add(self, **counts: int) -> None:
        with self._lock:
            for name, n in counts.items():
                setattr(self, name, getattr(self, name) + n)

    def timed(self, step: str, seconds: float) -> None:
        """Add one ``step`` (a key of :data:`TIMED_STEPS`) that took ``seconds``."""
        with self._lock:
            t = self.timings.get(step)
            if t is None:
                t = self.timings[step] = [0, 0.0, seconds, {}]
            t[0] += 1
            t[1] += seconds
            t[2] = max(t[2], seconds)
            hist = t[3]
            b = _bin(seconds)
            hist[b] = hist.get(b, 0) + 1

    def fallback(self, peer: str, reason: str, worker: str, detail: str = "") -> None:
        """Count a same-host fallback; log once per (peer, reason): WARNING, INFO for :data:`EXPECTED_REASONS`."""
        with self._lock:
            self.fallbacks[reason] = self.fallbacks.get(reason, 0) + 1
            first = (peer, reason) not in self._warned
            self._warned.add((peer, reason))
        if first:
            advice = FALLBACK_ADVICE.get(reason)
            logger.log(
                logging.INFO if reason in EXPECTED_REASONS else logging.WARNING,
                "gpupool: %s -> %s copied instead of handed over (%s: %s)%s%s; further fallbacks of this kind "
                "between them are counted in dask_gpupool.stats() without a warning",
                worker,
                peer,
                reason,
                FALLBACK_REASONS.get(reason, reason),
                f": {detail}" if detail else "",
                f". To hand it over: {advice}" if advice else "",
            )

    def to_msg(self) -> dict[str, Any]:
        with self._lock:
            return {
                "exports": self.exports,
                "imports": self.imports,
                "forwards": self.forwards,
                "returns": self.returns,
                "zero_copy_bytes": self.zero_copy_bytes,
                "copied_bytes": self.copied_bytes,
                "copied_out_bytes": self.copied_out_bytes,
                "streamed_bytes": self.streamed_bytes,
                "streamed_out_bytes": self.streamed_out_bytes,
                "device_frames_bytes": self.device_frames_bytes,
                "device_frames_out_bytes": self.device_frames_out_bytes,
                "device_staged_bytes": self.device_staged_bytes,
                "host_frames_bytes": self.host_frames_bytes,
                "host_frames_out_bytes": self.host_frames_out_bytes,
                "receive_pooled_bytes": self.receive_pooled_bytes,
                "receive_pool_misses": self.receive_pool_misses,
                "pool_staged_bytes": self.pool_staged_bytes,
                "fallbacks": dict(self.fallbacks),
                "timings": {
                    step: {
                        "count": int(n),
                        "total_s": total,
                        "max_s": longest,
                        "hist": {str(b): c for b, c in sorted(hist.items())},
                    }
                    for step, (n, total, longest, hist) in self.timings.items()
                },
            }


def _bin(seconds: float) -> int:
    """The histogram bin of a duration: ``floor(BINS_PER_OCTAVE * log2(µs))``, 0 for anything under 1 µs."""
    us = seconds * 1e6
    return max(0, math.floor(BINS_PER_OCTAVE * math.log2(us))) if us > 1 else 0


def quantile_s(hist: Mapping[str, int], q: float) -> float | None:
    """The ``q`` quantile (0 to 1) in seconds of the durations a timed step's ``hist`` counts, or ``None`` if empty.

    ``hist`` is a step's ``"hist"`` in ``stats()[worker]["timings"]`` (or a difference of two:
    :func:`subtract_hist`). The answer is the geometric middle of the bin holding that sample: within 9% of it.
    """
    bins = sorted((int(b), int(c)) for b, c in hist.items() if int(c) > 0)
    total = sum(c for _, c in bins)
    if not total:
        return None
    rank = min(max(q, 0.0), 1.0) * (total - 1)
    seen = 0
    for b, c in bins:
        seen += c
        if seen > rank:
            return 2 ** ((b + 0.5) / BINS_PER_OCTAVE) / 1e6 if b else 0.5e-6
    return None  # not reached


def subtract_hist(after: Mapping[str, int], before: Mapping[str, int]) -> dict[str, int]:
    """The durations ``after`` counts that ``before`` (an earlier ``hist`` of the same step) did not."""
    out = {b: int(c) - int(before.get(b, 0)) for b, c in after.items()}
    return {b: c for b, c in out.items() if c > 0}
