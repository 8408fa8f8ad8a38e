"""Expected failures in one log line: distributed's records of a gpupool error raised through a preload, a plugin's
setup or a plugin's registration, without their traceback.

distributed logs an exception that leaves a preload (``Failed to start preload``), a worker plugin's ``setup``
(``Worker plugin gpupool failed to setup``) or a scheduler plugin's ``start`` (``Exception while handling op
register_scheduler_plugin``) with its traceback, on every process it reaches. For a
:class:`~dask_gpupool.errors.GPUPoolError` (a bad option, a worker that cannot make a pool, a registration undone)
the error's own text says what is wrong and what to do: its record here becomes one line, ``<distributed's message>:
ConfigError: gpupool.max-size=...``, and a record of an error this package has logged already (:func:`said`) is left
out. Any other exception keeps its traceback: it is no failure this package expects.
"""

from __future__ import annotations

import logging
import weakref

from dask_gpupool.errors import GPUPoolError

__all__ = ["OneLine", "install", "said"]

#: distributed's loggers that log a failed preload, plugin setup or handler with its traceback.
LOGGERS = ("distributed.preloading", "distributed.worker", "distributed.core")

#: Errors logged in a line of this package's own already: distributed's record of them is left out.
_SAID: weakref.WeakSet[BaseException] = weakref.WeakSet()


def said(error: BaseException) -> None:
    """``error`` has been logged in one line, before it is raised on: distributed's record of it is left out."""
    if isinstance(error, GPUPoolError):  # the ones the filter looks at (and weakly referable: builtins are not)
        _SAID.add(error)


class OneLine(logging.Filter):
    """A record of a :class:`GPUPoolError` from a preload or plugin, made one line (or left out: :func:`said`)."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if not isinstance(error, GPUPoolError):
            return True
        text = record.getMessage()
        if "preload" not in text and "plugin" not in text:
            return True  # another of distributed's records (a task's, a transfer's): as distributed logs it
        if error in _SAID:
            return False
        record.msg, record.args = f"{text}: {type(error).__name__}: {error}", ()
        record.exc_info, record.exc_text = None, None
        return True


def install() -> None:
    """Put :class:`OneLine` on distributed's loggers of this process (:data:`LOGGERS`), once. Idempotent."""
    for name in LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, OneLine) for f in logger.filters):
            logger.addFilter(OneLine())
