"""Where this process runs: its host identity and the GPUs it can see.

GPUs are identified by UUID everywhere outside this process, because
ordinals differ between workers (dask-cuda rotates ``CUDA_VISIBLE_DEVICES``
so that ordinal 0 is each worker's own GPU).
"""

from __future__ import annotations

import functools
import os
import socket
from dataclasses import dataclass
from typing import Any

from dask_gpupool.errors import ConfigError

__all__ = ["LocalDevices", "current_gpu", "host_identity", "host_memory", "local_devices", "sleeping_event"]

_BOOT_ID = "/proc/sys/kernel/random/boot_id"


def host_identity(override: str | None = None) -> tuple[str, str]:
    """Return ``(host id, hostname)`` of this process.

    The host id is ``override`` when given, else ``"<hostname>/<boot id>"``:
    two processes share memory only if their host ids are equal, and the boot
    id tells apart two containers or machines that share a hostname.
    """
    hostname = socket.gethostname()
    if override:
        return override, hostname
    try:
        with open(_BOOT_ID) as f:
            boot_id = f.read().strip()
    except OSError:
        boot_id = "no-boot-id"
    return f"{hostname}/{boot_id}", hostname


def host_memory() -> int:
    """Bytes of physical memory on this host."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _canonical(device_uuid: str) -> str:
    """``GPU-<uuid>``, the form nvidia-smi prints and CUDA_VISIBLE_DEVICES accepts."""
    return "GPU-" + _normalize(device_uuid)


def _normalize(device_uuid: str) -> str:
    text = device_uuid.strip().lower()
    return text[4:] if text.startswith("gpu-") else text


@dataclass(frozen=True)
class LocalDevices:
    """The GPUs visible to this process, by ordinal.

    Attributes
    ----------
    uuids : tuple of str
        ``uuids[i]`` is the UUID of ordinal ``i`` in this process, as ``"GPU-..."``.
    """

    uuids: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.uuids)

    def ordinal_of(self, device_uuid: str | None) -> int | None:
        """Ordinal of the GPU with this UUID here, or ``None`` if not visible."""
        if device_uuid is None:
            return None
        key = _normalize(device_uuid)
        for i, u in enumerate(self.uuids):
            if _normalize(u) == key:
                return i
        return None

    def resolve(self, spec: int | str) -> int:
        """Ordinal named by ``gpupool.device`` (an ordinal or a UUID).

        Raises
        ------
        ConfigError
            If no such GPU is visible to this process.
        """
        if isinstance(spec, int):
            if spec < len(self.uuids):
                return spec
        else:
            ordinal = self.ordinal_of(spec)
            if ordinal is not None:
                return ordinal
        raise ConfigError(
            f"gpupool.device={spec!r} is not visible to this process; valid: ordinals "
            f"0..{len(self.uuids) - 1} or one of {list(self.uuids)}"
            if self.uuids
            else f"gpupool.device={spec!r}: this process sees no CUDA device"
        )


@functools.cache
def local_devices() -> LocalDevices:
    """The CUDA devices this process sees; empty without a driver or a device.

    Initializes the CUDA driver (no context is made). The answer is cached:
    ``CUDA_VISIBLE_DEVICES`` cannot change once the driver is initialized.
    """
    try:
        from cuda.bindings import driver

        (err,) = driver.cuInit(0)
        if err != driver.CUresult.CUDA_SUCCESS:
            return LocalDevices()
        err, count = driver.cuDeviceGetCount()
        if err != driver.CUresult.CUDA_SUCCESS or count == 0:
            return LocalDevices()
        from cuda.core import Device

        return LocalDevices(tuple(_canonical(str(Device(i).uuid)) for i in range(count)))
    except (ImportError, RuntimeError, OSError):
        # No driver library (cuda.pathfinder raises a RuntimeError subclass).
        return LocalDevices()


def device_memory(ordinal: int) -> int:
    """Total bytes of memory of GPU ``ordinal``."""
    from cuda.bindings import driver

    err, dev = driver.cuDeviceGet(ordinal)
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuDeviceGet({ordinal}) failed: {err!r}")
    err, total = driver.cuDeviceTotalMem(dev)
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuDeviceTotalMem({ordinal}) failed: {err!r}")
    return int(total)


def current_gpu(ordinal: int | None) -> Any:
    """The cuda.core ``Device`` ``ordinal`` (``None``: the thread's current one), made current in the calling thread.

    CUDA calls run against the calling thread's current context, and our code
    runs on many threads (task threads, the event loop, the broker's, the
    garbage collector's), so every CUDA path starts here.
    """
    from cuda.core import Device

    dev = Device(ordinal)
    dev.set_current()
    return dev


def sleeping_event(stream: Any) -> Any:
    """An event recorded on the cuda.core ``stream`` whose ``sync()`` sleeps until the GPU is done, not spins.

    For waits that may be long and run on helper threads (a release waiting
    for a consumer's kernels, a claim waiting for a producer's): a
    busy-waiting event (cuda.core's default) would keep a core busy the
    whole time.
    """
    from cuda.core import EventOptions

    return stream.record(options=EventOptions(blocking_sync=True))
