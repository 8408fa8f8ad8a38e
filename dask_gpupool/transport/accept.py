"""The back-off that keeps an accept loop alive: shared by the fd broker and the copy server.

A server that stops accepting for good is a denial of service (an fd flood
would end both accept loops with ``EMFILE``). An accept loop asks
:meth:`AcceptBackoff.failed` what to do after each failed ``accept``: try again
at once (a transient error: the peer gave up, a signal) or pause, 50 ms
doubling up to :data:`ACCEPT_BACKOFF_MAX` (out of fds or memory), while the
queued peers wait in the listen backlog. It logs once when it starts backing
off and once when it accepts again.
"""

from __future__ import annotations

import errno
import logging

__all__ = ["ACCEPT_BACKOFF_MAX", "AcceptBackoff"]

logger = logging.getLogger(__name__)

#: Longest pause between accept attempts after a failure, in seconds.
ACCEPT_BACKOFF_MAX = 1.0

#: Errors of one connection, not of the server: accept again at once.
_TRANSIENT = frozenset({errno.ECONNABORTED, errno.EPROTO, errno.EINTR, errno.EAGAIN})


class AcceptBackoff:
    """How long an accept loop pauses after a failed ``accept``.

    Parameters
    ----------
    what : str
        The server, as its log lines name it (``"pool <uuid>: broker"``).

    Attributes
    ----------
    errors : int
        Failed accepts that were not transient (each made the loop pause).
    """

    what: str
    errors: int
    _pause: float

    def __init__(self, what: str) -> None:
        self.what = what
        self.errors = 0
        self._pause = 0.0

    def failed(self, e: OSError) -> float:
        """Seconds to pause before accepting again after ``e`` (0: at once, a transient error)."""
        if e.errno in _TRANSIENT:
            return 0.0
        self.errors += 1
        if not self._pause:
            logger.warning(
                "%s cannot accept (%s); retrying, backing off up to %.0f s", self.what, e, ACCEPT_BACKOFF_MAX
            )
        self._pause = min(max(2 * self._pause, 0.05), ACCEPT_BACKOFF_MAX)
        return self._pause

    def accepted(self) -> None:
        """A connection was accepted: end the back-off (and say so if there was one)."""
        if self._pause:
            logger.warning("%s accepts again", self.what)
            self._pause = 0.0
