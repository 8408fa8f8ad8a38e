"""A user's type with a ``"cuda"`` serializer that distributed does not know, and the tasks that make and check it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from cuda.core import Buffer


class DeviceRecord:
    """A user's type with a ``"cuda"`` serializer (not one distributed knows): a tag and a CuPy byte array.

    Its ``cuda_deserialize`` reads the array on arrival (``arrival_sum``), as a
    cuDF column's may: a consumer that read before the lease was claimed, or
    before the producer's kernel wrote, would record a wrong sum. For
    ``dask/frames_family.py``.
    """

    def __init__(self, tag: str, data: Any, arrival_sum: int | None = None) -> None:
        self.tag, self.data, self.arrival_sum = tag, data, arrival_sum


class RmmFramesRecord(DeviceRecord):
    """A :class:`DeviceRecord` whose deserializer accepts only ``rmm.DeviceBuffer`` frames, as RMM's own does."""


def _register_records() -> None:
    from distributed.protocol.cuda import cuda_deserialize, cuda_serialize

    def dumps(x: DeviceRecord) -> tuple[dict[str, Any], list[Any]]:
        return {"tag": x.tag}, [x.data]

    def loads_record(header: dict[str, Any], frames: list[Any]) -> DeviceRecord:
        import cupy

        arr = cupy.asarray(frames[0]).view("u1").ravel()
        return DeviceRecord(header["tag"], arr, int(arr.sum(dtype="u8")))

    def loads_rmm_record(header: dict[str, Any], frames: list[Any]) -> DeviceRecord:
        import cupy
        import rmm

        assert isinstance(frames[0], rmm.DeviceBuffer), type(frames[0])
        arr = cupy.asarray(frames[0]).view("u1").ravel()
        return RmmFramesRecord(header["tag"], arr, int(arr.sum(dtype="u8")))

    for typ, loads in ((DeviceRecord, loads_record), (RmmFramesRecord, loads_rmm_record)):
        cuda_serialize.register(typ)(dumps)
        cuda_deserialize.register(typ)(loads)


_register_records()


def device_record(buf: Buffer, tag: str, rmm_frames: bool = False) -> DeviceRecord:
    """Task: a :class:`DeviceRecord` (or :class:`RmmFramesRecord`) over the whole of ``buf``, no copy."""
    from dask_gpupool import as_array

    arr = as_array(buf, (buf.size,), "u1", like="cupy")
    return (RmmFramesRecord if rmm_frames else DeviceRecord)(tag, arr)


def check_device_record(x: DeviceRecord, value: int) -> str:
    """Task: ``"<type name>:ok"`` when every byte of ``x`` is ``value`` and so was its sum on arrival."""
    import cupy

    want = int(x.data.size) * value
    now = int(x.data.sum(dtype="u8"))
    cupy.cuda.runtime.deviceSynchronize()
    ok = x.arrival_sum == want and now == want
    return f"{type(x).__name__}:{'ok' if ok else f'wrong (arrival {x.arrival_sum}, now {now}, want {want})'}"
