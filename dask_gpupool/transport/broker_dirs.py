"""Where brokers put their sockets: a private directory each, and the ones dead brokers left behind.

Each :class:`~dask_gpupool.transport.broker.FdBroker` binds its socket in a
directory of its own (``mkdtemp``, mode 0700) under ``gpupool.broker-dir`` or
the system's temporary directory. A broker that is SIGKILLed cannot remove
it; :func:`remove_stale_broker_dirs`, run before each broker makes its own,
removes those nobody listens on any more.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import stat
import time

__all__ = ["DIR_PREFIX", "SOCKET_NAME", "STALE_AFTER", "remove_stale_broker_dirs"]

logger = logging.getLogger(__name__)

#: The broker's socket, inside its directory.
SOCKET_NAME = "broker.sock"


#: Prefix of every broker directory (``mkdtemp`` adds the pool's first 8 characters and a random suffix).
DIR_PREFIX = "dask-gpupool-"


#: Broker directories changed less than this many seconds ago are never judged stale: a broker may be
#: starting in one (``mkdtemp`` comes before ``bind``).
STALE_AFTER = 10.0


def remove_stale_broker_dirs(parent: str, min_age: float = STALE_AFTER) -> list[str]:
    """Remove the broker directories in ``parent`` that brokers left when they died without closing.

    A broker killed with SIGKILL (or a worker that crashed) leaves its private
    directory and socket behind. :class:`FdBroker` calls this before it makes
    its own directory. An entry is removed only when all of these hold:

    - its name starts with ``dask-gpupool-``;
    - it is a directory, not a link to one (``lstat``), owned by this
      process's uid;
    - it was last modified more than ``min_age`` seconds ago;
    - nobody listens on it: it has no ``broker.sock``, or that is a socket of
      ours and connecting to it is refused (``ECONNREFUSED``).

    Then the socket file is unlinked and the directory removed with ``rmdir``,
    so a directory that holds anything else stays. Other users' directories,
    live brokers' (even of another cluster: a connection that sends nothing
    is closed by the broker) and anything that cannot be judged are left
    alone. ``gpupool.broker-dir`` must be host-local: a socket on a shared
    filesystem would look dead from every other host.

    Parameters
    ----------
    parent : str
        The directory brokers make their directories in.
    min_age : float
        Seconds since a directory's last change before it may count as stale.

    Returns
    -------
    list of str
        The directories removed. Never raises for an entry it cannot read or
        remove; it leaves it.

    Notes
    -----
    Blocking, in the caller's thread: one non-blocking ``connect`` per
    candidate. Each probe's socket is opened and closed here.
    """
    removed: list[str] = []
    try:
        entries = list(os.scandir(parent))
    except OSError as e:
        logger.debug("broker directory %s cannot be listed: %s", parent, e)
        return removed
    uid, now = os.getuid(), time.time()
    for entry in entries:
        if not entry.name.startswith(DIR_PREFIX):
            continue
        try:
            st = entry.stat(follow_symlinks=False)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != uid or now - st.st_mtime < min_age:
                continue
            address = os.path.join(entry.path, SOCKET_NAME)
            try:
                sst = os.lstat(address)
            except FileNotFoundError:
                pass  # died before bind, or its socket is gone: nobody can listen here
            else:
                if not stat.S_ISSOCK(sst.st_mode) or sst.st_uid != uid or not _refused(address):
                    continue
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(address)
            os.rmdir(entry.path)
        except FileNotFoundError:
            continue  # removed meanwhile (another broker starting here cleans up too)
        except OSError as e:
            logger.debug("broker directory %s left as it is: %s", entry.path, e)
            continue
        logger.info("removed the stale broker directory %s (its broker died without closing)", entry.path)
        removed.append(entry.path)
    return removed


def _refused(address: str) -> bool:
    """Whether connecting to the socket at ``address`` is refused: nobody listens on it."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC) as probe:
        probe.setblocking(False)
        try:
            probe.connect(address)
        except ConnectionRefusedError:
            return True
        except OSError:  # a full backlog (EAGAIN) is a live broker; anything else cannot be judged
            return False
        return False
