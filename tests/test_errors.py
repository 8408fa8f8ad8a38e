"""What a user's client catches when a task raises one of our errors (errors keep their class)."""

from __future__ import annotations

import pickle

import pytest
from conftest import nanny_cluster

import dask_gpupool
from dask_gpupool import GPUPool
from dask_gpupool import errors as _errors

ERRORS = [getattr(_errors, name) for name in _errors.__all__]


def raise_error(name: str) -> None:
    """Task: raise dask_gpupool's error ``name``."""
    raise getattr(dask_gpupool, name)(f"a {name} from a task")


def allocate_too_much() -> None:
    """Task: ask the worker's pool for far more than it holds."""
    dask_gpupool.allocate(1 << 40)


@pytest.mark.parametrize("cls", ERRORS, ids=lambda c: c.__name__)
def test_every_error_survives_distributeds_exception_pickling(cls):
    """distributed sends a task's exception with tblib's pickling; each class must come back as itself."""
    import tblib.pickling_support
    from distributed.protocol import pickle as dask_pickle

    e = cls("message")
    tblib.pickling_support.install(e)
    back = dask_pickle.loads(dask_pickle.dumps(e))
    assert type(back) is cls and str(back) == "message"
    assert type(pickle.loads(pickle.dumps(cls("m")))) is cls
    assert issubclass(cls, dask_gpupool.GPUPoolError)


def test_the_client_catches_each_error_a_task_raises_by_its_class():
    with nanny_cluster([{}], GPUPool(kind="host", max_size="64 MiB")) as c:
        for cls in ERRORS:
            with pytest.raises(cls, match=f"a {cls.__name__} from a task"):
                c.submit(raise_error, cls.__name__, pure=False).result()
        with pytest.raises(dask_gpupool.PoolExhaustedError, match="more than the whole pool") as info:
            c.submit(allocate_too_much, pure=False).result()
        assert isinstance(info.value, MemoryError)
