"""``--preload dask_gpupool`` for ``dask scheduler`` and ``dask worker``.

Scheduler: installs :class:`~dask_gpupool.GPUPool`, exactly as
``client.register_plugin`` would. Worker: asks its scheduler to install
``GPUPool`` if it has none yet (idempotent), and receives the worker plugin
from the scheduler like every other worker; so a cluster whose workers alone
preload dask_gpupool ends up the same. Options come from ``--preload-argv``
or from dask config.
"""

from __future__ import annotations

from typing import Any

import click
from distributed import Scheduler, Worker
from distributed.protocol.pickle import dumps

from dask_gpupool._config import KINDS
from dask_gpupool._scheduler_plugin import GPUPool
from dask_gpupool._worker_plugin import PLUGIN_NAME

__all__ = ["dask_setup"]


@click.command(name="dask_gpupool")
@click.option("--gpupool-kind", "kind", type=click.Choice(KINDS), default=None, help="gpupool.kind")
@click.option("--gpupool-device", "device", default=None, help="gpupool.device (ordinal or UUID)")
@click.option("--gpupool-max-size", "max_size", default=None, help='gpupool.max-size ("8 GiB", "50%")')
@click.option("--gpupool-host-id", "host_id", default=None, help="gpupool.host-id")
@click.option("--gpupool-broker-dir", "broker_dir", default=None, help="gpupool.broker-dir")
@click.option("--gpupool-broker-timeout", "broker_timeout", default=None, help='gpupool.broker-timeout ("10s")')
@click.option("--gpupool-lease-timeout", "lease_timeout", default=None, help='gpupool.lease-timeout ("60s")')
async def dask_setup(dask_object: Scheduler | Worker, **options: Any) -> None:
    plugin = GPUPool(**options)
    if isinstance(dask_object, Scheduler):
        await dask_object.register_scheduler_plugin(plugin, name=PLUGIN_NAME, idempotent=True)
    else:
        await dask_object.scheduler.register_scheduler_plugin(plugin=dumps(plugin), name=PLUGIN_NAME, idempotent=True)
