"""``--preload dask_gpupool`` for ``dask scheduler`` and ``dask worker``.

Scheduler: installs :class:`~dask_gpupool.GPUPool`, exactly as
``client.register_plugin`` would. Worker: asks its scheduler to install
``GPUPool`` if it has none yet (idempotent), and receives the worker plugin
from the scheduler like every other worker; so a cluster whose workers alone
preload dask_gpupool ends up the same. Options come from the preload's
arguments (``--gpupool-<key> VALUE`` after ``--preload dask_gpupool``, one
per ``gpupool.*`` key) or from dask config.
"""

from __future__ import annotations

import logging
from typing import Any

import click
import dask
from distributed import Scheduler, Worker
from distributed.protocol.pickle import dumps

from dask_gpupool.config import KINDS, PoolOptions
from dask_gpupool.core import PLUGIN_NAME
from dask_gpupool.dask.distributed_seam import workers as seam
from dask_gpupool.dask.scheduler_plugin import GPUPool
from dask_gpupool.errors import ConfigError

__all__ = ["dask_setup"]

logger = logging.getLogger(__name__)


def _with_every_option(command: Any) -> Any:
    """Add ``--gpupool-<key>`` for every ``gpupool.*`` option (the values are checked by :class:`GPUPool`)."""
    for name in reversed(list(PoolOptions.__dataclass_fields__)):
        key = name.replace("_", "-")
        kind: Any = click.Choice(KINDS) if name == "kind" else None
        metavar = None if name == "kind" else "VALUE"
        option = click.option(f"--gpupool-{key}", name, type=kind, default=None, metavar=metavar, help=f"gpupool.{key}")
        command = option(command)
    return command


class _PreloadCommand(click.Command):
    """The preload's arguments, whose usage and errors name the command they were given to.

    Dask parses them in a context of their own with no name (``dask worker`` checks them before it starts a
    worker; the worker parses them again as ``dask_setup``): click's usage read ``Usage:  [OPTIONS]`` and its hint
    ``Try ' --help' for help.``. Here they read ``Usage: dask worker --preload dask_gpupool [--gpupool-<key>
    VALUE]...``, with the command as it was run (``dask worker``, ``dask-scheduler``, ``python -m ...``), and the
    hint names the command that prints this help: ``--help`` goes to the preload only after ``--`` (before it, it
    is ``dask worker``'s own).
    """

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        outer = click.get_current_context(silent=True)
        program, help_command = "", "--preload dask_gpupool -- --help"
        if outer is not None and outer is not ctx:  # dask worker's or dask scheduler's own context, checking these
            program = f"{outer.command_path} "
            arguments = [p for p in outer.command.params if isinstance(p, click.Argument) and p.name != "preload_argv"]
            help_command = " ".join([outer.command_path, *(p.human_readable_name for p in arguments), help_command])
        if not ctx.info_name or ctx.info_name == "dask_setup":
            ctx.info_name = f"{program}--preload dask_gpupool"
        ctx.meta[_HELP_COMMAND] = help_command
        try:
            return super().parse_args(ctx, args)
        except click.UsageError as e:
            if e.ctx is None:  # an option without its value: click would show dask worker's usage instead
                e.ctx = ctx
            raise

    def get_usage(self, ctx: click.Context) -> str:
        """The usage line and the hint that an error shows (click's hint is left out: ``add_help_option=False``)."""
        return f"{super().get_usage(ctx)}\nTry '{ctx.meta.get(_HELP_COMMAND, '--help')}' for help."


_HELP_COMMAND = "dask_gpupool.help-command"


@click.command(
    name="dask_gpupool",
    cls=_PreloadCommand,
    options_metavar="[--gpupool-<key> VALUE]...",
    add_help_option=False,  # its own --help below: click's hint would name one that reaches dask worker instead
    help="Run dask_gpupool in this scheduler or worker. Each --gpupool-<key> VALUE sets the option gpupool.<key> "
    "for it (dask_gpupool's configuration page lists them); a worker checks the values before it starts, and one "
    "with a bad value joins without a pool.",
)
@click.help_option("--help")
@_with_every_option
async def dask_setup(dask_object: Scheduler | Worker, **options: Any) -> None:
    """Install dask_gpupool (``--preload dask_gpupool``); options as ``--gpupool-<key> VALUE`` arguments.

    On a worker, the options (arguments over the worker's dask config) are
    checked here, before the worker starts, and become that worker's dask
    config, and only that worker's: the ``GPUPool`` it asks the scheduler to
    install (if none is yet) sets no option, so every worker reads its own.
    A bad value is logged in one line (the :class:`~dask_gpupool.ConfigError`
    naming the key), and the worker joins without a pool, whatever
    registration comes, reported as ``no pool: ConfigError: ...`` by
    ``stats()``, ``info`` and the ``/gpupool`` page.
    """
    seam.one_line_failures()  # distributed logs a gpupool error raised here in one line, not with its traceback
    options = {k: v for k, v in options.items() if v is not None}
    if isinstance(dask_object, Scheduler):
        plugin = GPUPool(**options)  # checks the values given, each on its own and against each other
        plugin.idempotent = True
        await dask_object.register_scheduler_plugin(plugin, name=PLUGIN_NAME, idempotent=True)
        return
    try:
        # Checked over this worker's own dask config, the one its pool reads (each value, and the whole).
        PoolOptions.from_config(**options)
    except ConfigError as e:
        # Not raised: distributed would log a traceback and start the worker with its config unchanged, so that
        # its pool took the default in place of the bad value. This worker gets no pool (said once, here).
        from dask_gpupool.dask.worker_plugin import refuse_pool  # the worker stack, loaded on workers only

        why = f"{type(e).__name__}: {e}"
        logger.error("gpupool: this worker joins with no pool: %s", why)
        refuse_pool(dask_object, why)
        options = {}
    if options:
        # This worker's own config from now on: its plugin reads every option the scheduler's GPUPool
        # does not set from here, whichever process registered GPUPool first.
        dask.config.set({f"gpupool.{k.replace('_', '-')}": v for k, v in options.items()})
    # Without options: the GPUPool a worker registers would give them to every worker, overriding
    # each one's own arguments and config.
    # Idempotent: one registered by another worker while this one's waited for its turn (GPUPool.start) is kept.
    plugin = GPUPool()
    plugin.idempotent = True
    await dask_object.scheduler.register_scheduler_plugin(plugin=dumps(plugin), name=PLUGIN_NAME, idempotent=True)
