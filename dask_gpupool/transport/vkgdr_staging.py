"""Device-memory landing slots for the streamed copy, mapped into the host by vkgdr.

A value pulled from another host over TCP (:mod:`dask_gpupool.transport.pull`)
arrives chunk by chunk. Where vkgdr runs, the chunks are received straight into GPU
memory that `vkgdr <https://pypi.org/project/vkgdr/>`_ maps into the host's
address space through Vulkan (``HOST_VISIBLE | DEVICE_LOCAL``): the kernel's
``recv`` writes the bytes to the GPU, and a device-to-device copy moves each
chunk into the value's pool buffer (vkgdr memory cannot be in the worker's
IPC pool). Why a dependency: vkgdr is the maintained way to get such a
mapping from Python (it wraps the Vulkan calls and their CUDA interop); it
needs the Vulkan loader and NVIDIA's Vulkan driver on the host, so it is an
optional extra (``pip install dask-gpupool[vkgdr]``) and a worker without it
receives each chunk into pinned host staging and copies it to the GPU
(:mod:`dask_gpupool.transport.staging`), saying why once.

Ownership: a :class:`VkgdrSlot` owns its vkgdr allocation, freed by
:meth:`VkgdrSlot.free` with its GPU current; :data:`VKGDR` keeps sets of
slots for the next pull like the pinned staging does, until the process's last
pool service lets go of them (:func:`~dask_gpupool.transport.staging.let_go_slots`).
Loaded only where a pull lands on a GPU.
"""

from __future__ import annotations

import logging
from typing import Any

from dask_gpupool.memory.topology import current_gpu
from dask_gpupool.transport.staging import SLOTS, KeptSlots, per_process

__all__ = ["VKGDR", "VkgdrSlot", "VkgdrStaging"]

logger = logging.getLogger(__name__)


class VkgdrSlot:
    """One landing chunk of GPU memory, mapped into the host.

    Attributes
    ----------
    device_ptr : int
        Its CUDA device pointer (the source of the device-to-device copy).
    host : memoryview
        Writable bytes of the mapping (``recv_into`` target).
    """

    __slots__ = ("_atom", "_coherent", "_device", "_mem", "device_ptr", "host", "size")

    def __init__(self, handle: Any, device: int, size: int) -> None:
        import numpy as np
        import vkgdr

        self._device = device
        self._mem = vkgdr.RawMemory(handle, size)
        self.size = size
        self.device_ptr = int(self._mem.device_ptr)
        self.host = np.asarray(self._mem).view(np.uint8).data.cast("B")
        self._coherent = bool(self._mem.is_coherent)
        self._atom = max(int(self._mem.non_coherent_atom_size), 1)

    def flush(self, n: int) -> None:
        """Make the first ``n`` bytes the host wrote visible to the GPU (nothing to do on coherent memory)."""
        if self._coherent or n <= 0:
            return
        n = min(-(-n // self._atom) * self._atom, self.size)  # whole atoms, or up to the allocation's end
        self._mem.flush(0, n)

    def free(self) -> None:
        """Free the allocation (its GPU made current first). Idempotent."""
        if self._mem is None:
            return
        current_gpu(self._device)
        self._mem.free()
        self._mem = None


class VkgdrStaging(KeptSlots[VkgdrSlot]):
    """vkgdr landing slots of this process, per (GPU, chunk size), kept for the next pull.

    :meth:`take` raises when vkgdr cannot be used on that GPU (not
    installed, no Vulkan loader or driver, no host-visible device memory);
    :meth:`unavailable` says why without raising, remembered per GPU. The
    vkgdr handles stay open for the process (:meth:`clear` frees the slots).
    """

    def __init__(self, keep: int = 8) -> None:
        super().__init__(keep)
        self._handles: dict[int, Any] = {}
        self._errors: dict[int, str] = {}

    def unavailable(self, device: int) -> str | None:
        """Why vkgdr cannot land copies on GPU ``device`` (``None``: it can). Opens vkgdr on first use."""
        with self._lock:
            if device in self._errors:
                return self._errors[device]
        try:
            self._handle(device)
        except Exception as e:
            return f"{type(e).__name__}: {e}"
        return None

    def _handle(self, device: int) -> Any:
        with self._lock:
            if device in self._handles:
                return self._handles[device]
            if device in self._errors:
                raise RuntimeError(self._errors[device])
        try:
            import vkgdr

            current_gpu(device)  # vkgdr opens the calling thread's current CUDA context: this GPU's primary one
            handle = vkgdr.Vkgdr.open_current_context()
        except Exception as e:
            with self._lock:
                self._errors[device] = f"{type(e).__name__}: {e}"
            raise
        with self._lock:
            return self._handles.setdefault(device, handle)

    def take(self, device: int, chunk: int) -> list[VkgdrSlot]:
        """:data:`~dask_gpupool.transport.staging.SLOTS` slots of ``chunk`` bytes on ``device`` (owned by the
        caller until :meth:`give`)."""
        kept = self._kept(device, chunk)
        if kept is not None:
            return kept
        handle = self._handle(device)
        slots: list[VkgdrSlot] = []
        try:
            for _ in range(SLOTS):
                slots.append(VkgdrSlot(handle, device, chunk))
        except BaseException:
            for slot in slots:
                slot.free()
            raise
        return slots

    def _free_slot(self, slot: VkgdrSlot) -> None:
        slot.free()

    def _slot_size(self, slot: VkgdrSlot) -> int:
        return slot.size


#: This process's vkgdr landing slots: truly per process (a cache of this process's vkgdr mappings and handles).
VKGDR = VkgdrStaging()
per_process(VKGDR)
