"""The command line: ``dask gpupool {demo,info,trim}`` (also ``python -m dask_gpupool ...``).

``dask gpupool`` is found by Dask's own ``dask`` command through the
``dask_cli`` entry point, as ``dask cuda`` is for dask-cuda.

``demo`` starts a local cluster with the plugin and hands a buffer from one
worker to another (:mod:`dask_gpupool.demo`).

``info [ADDRESS]`` connects to a running cluster and prints its pool registry
and every worker's pool and handoff statistics as tables. ``peer GPUs`` counts
the other GPUs granted access to a ``device`` pool: workers there map it
zero-copy (:attr:`~dask_gpupool.PoolRecord.peers`).

``trim [ADDRESS]`` has every worker give its pool's memory back
(:func:`dask_gpupool.trim`) and prints what each holds right after.

``info`` and ``trim`` take the scheduler's address, or ``--scheduler-file``,
and Dask's TLS options (``--tls-ca-file``, ``--tls-cert``, ``--tls-key``). A
scheduler that cannot be reached is one line on stderr and exit status 2; a
worker that does not answer within ``--timeout`` is listed as such.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
from collections.abc import Iterator
from typing import Any, NoReturn

import click


def info(target: _Target) -> int:
    """Print the registry and per-worker stats of the cluster; 0 on success, 2 if it has no gpupool registry."""
    from dask.utils import format_bytes

    import dask_gpupool
    from dask_gpupool.ops.summary import problem

    address = target.name
    with target.client() as client:
        try:
            rows = sorted(dask_gpupool.pools(client), key=lambda r: r.worker)
        except dask_gpupool.PoolUnavailableError as e:
            print(f"{address}: {e}", file=sys.stderr)
            return 2
        usage = dask_gpupool.pool_stats(client, timeout=target.timeout)
        handoffs = dask_gpupool.stats(client, timeout=target.timeout)
    print(f"{len(rows)} pool(s) at {address}\n")
    print(
        f"{'worker':28} {'host':16} {'kind':6} {'device':14} {'used':>10} {'reserved':>10} {'max':>10}  "
        f"{'peer GPUs':>9}  pool"
    )
    for r in rows:
        u = usage.get(r.worker, {})
        used, reserved = (format_bytes(u[k]) if k in u else "-" for k in ("used", "reserved"))
        print(
            f"{r.worker:28} {r.hostname[:16]:16} {r.kind:6} {(r.device or '-')[:14]:14} "
            f"{used:>10} {reserved:>10} "
            f"{format_bytes(r.max_size):>10}  {len(r.peers):>9}  {r.pool}"
        )
    print(
        f"\n{'worker':28} {'exports':>8} {'imports':>8} {'leases':>7} {'lent':>10} {'borrowed':>10} "
        f"{'zero-copy in':>13} {'copied in':>10} {'copied out':>10} {'segments':>9}  fallbacks"
    )
    for w, h in sorted(handoffs.items()):
        if "error" in h:
            print(f"{w:28} {problem(h['error'])}")
            continue
        fallbacks = ", ".join(f"{k} {v}" for k, v in sorted(h["fallbacks"].items())) or "-"
        print(
            f"{w:28} {h['exports']:>8} {h['imports']:>8} {h['leases']:>7} {format_bytes(h['lease_bytes']):>10} "
            f"{format_bytes(h.get('borrowed_bytes', 0)):>10} {format_bytes(h['zero_copy_bytes']):>13} "
            f"{format_bytes(h['copied_bytes']):>10} "
            f"{format_bytes(h['copied_out_bytes']):>10} {_segments(h):>9}  {fallbacks}"
        )
    return 0


def _segments(h: dict[str, Any]) -> str:
    """``held`` or ``held (retiring)``."""
    held, retiring = h.get("segments", 0), h.get("segments_retiring", 0)
    return f"{held} ({retiring})" if retiring else str(held)


def trim(target: _Target) -> int:
    """Give every worker's pool memory back (:func:`dask_gpupool.trim`) and print the result; 0 on success."""
    from dask.utils import format_bytes

    import dask_gpupool
    from dask_gpupool.ops.summary import problem

    address = target.name
    with target.client() as client:
        try:
            dask_gpupool.pools(client)
        except dask_gpupool.PoolUnavailableError as e:
            print(f"{address}: {e}", file=sys.stderr)
            return 2
        result = dask_gpupool.trim(client, timeout=target.timeout)
    print(f"{'worker':28} {'segments':>9} {'retiring':>9} {'reserved':>10}")
    for w, t in sorted(result.items()):
        if "error" in t:
            print(f"{w:28} {problem(t['error'])}")
            continue
        print(f"{w:28} {t['segments']:>9} {t['segments_retiring']:>9} {format_bytes(t['reserved']):>10}")
    print("\nRetiring segments are freed as soon as no buffer lives in them and no peer maps them.")
    return 0


class _Target:
    """Which scheduler to connect to, and how (an address or a scheduler file; TLS when asked)."""

    def __init__(
        self,
        address: str | None,
        scheduler_file: str | None,
        timeout: float,
        tls_ca_file: str | None,
        tls_cert: str | None,
        tls_key: str | None,
    ) -> None:
        if (address is None) == (scheduler_file is None):
            raise click.UsageError("give the scheduler's ADDRESS or --scheduler-file, one of them")
        self.address, self.scheduler_file, self.timeout = address, scheduler_file, timeout
        self.security = None
        if tls_ca_file or tls_cert or tls_key:
            from distributed.security import Security

            self.security = Security(
                tls_ca_file=tls_ca_file, tls_client_cert=tls_cert, tls_client_key=tls_key, require_encryption=True
            )

    @property
    def name(self) -> str:
        return self.address or f"the scheduler of {self.scheduler_file}"

    def _fail(self, why: str) -> NoReturn:
        click.echo(f"cannot reach {self.name}: {why}", err=True)
        raise SystemExit(2)

    def _address(self) -> str:
        """The scheduler's address: given, or read from the scheduler file.

        Dask's ``Client(scheduler_file=...)`` waits for a missing file for ever and raises a bare
        ``AssertionError`` on one without an address: the file is read here instead, waiting for it (a
        scheduler starting) at most ``--timeout``.
        """
        if self.address is not None:
            return self.address
        assert self.scheduler_file is not None
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                with open(self.scheduler_file) as f:
                    address = json.load(f).get("address")
                if isinstance(address, str) and address:
                    return address
                why = "no scheduler address in it"
            except FileNotFoundError:
                why = f"no such file after {self.timeout:g} s"
            except (OSError, ValueError, AttributeError) as e:  # AttributeError: JSON that is not an object
                why = f"no scheduler address in it ({type(e).__name__}: {e})"
            if time.monotonic() >= deadline:  # a file being written: read again until the deadline
                self._fail(why)
            time.sleep(0.1)

    def _security_for(self, address: str) -> Any:
        """The TLS settings for ``address``, checked: Dask raises a bare ``RuntimeError`` for TLS options with a
        ``tcp://`` address and a ``TypeError`` when they make no TLS context (a key without a certificate)."""
        from distributed.comm import parse_address
        from distributed.security import Security

        scheme = parse_address(address)[0]
        if scheme == "wss":
            return self.security  # TLS over websockets, with or without a client certificate: Dask's to check
        if scheme != "tls":
            if self.security is not None:
                self._fail(
                    f"--tls-ca-file, --tls-cert and --tls-key are for a tls:// (or wss://) address, not {scheme}://"
                )
            return None
        security = self.security if self.security is not None else Security()  # else Dask's own TLS config
        try:
            context = security.get_connection_args("client")["ssl_context"]
        except (OSError, ValueError) as e:  # ssl.SSLError is an OSError
            self._fail(f"TLS: {type(e).__name__}: {e}")
        if context is None:
            self._fail(
                "a tls:// address needs --tls-ca-file and --tls-cert (and --tls-key unless the certificate file "
                "holds the key), or Dask's distributed.comm.tls configuration"
            )
        return security

    @contextlib.contextmanager
    def client(self) -> Iterator[Any]:
        from distributed import Client

        address = self._address()
        bad = _address_error(address)
        if bad is not None:
            self._fail(bad)
        security = self._security_for(address)
        try:
            client = Client(address, timeout=self.timeout, security=security, set_as_default=False)
        except (OSError, TimeoutError, ValueError) as e:
            self._fail(f"{type(e).__name__}: {e}")
        with client:
            yield client


def _address_error(address: str) -> str | None:
    """Why ``address`` is no address a client can connect to (an unknown scheme, no port), or ``None``.

    Checked before the client starts: Dask's ``Client`` raises ``ValueError`` for these from a half-started
    client, whose finalizer then waits twice the timeout at exit and prints a traceback.
    """
    from distributed.comm import parse_address
    from distributed.comm.registry import get_backend

    try:
        scheme, location = parse_address(address)
        backend = get_backend(scheme)
        if scheme in ("tcp", "tls"):  # other backends may load (or refuse) their transport on any call
            backend.get_address_host(location)
    except ValueError as e:
        return f"not a scheduler address: {e}"
    return None


def _positive_seconds(ctx: Any, param: Any, value: float) -> float:
    """``--timeout``: a finite number of seconds above 0, else click's usage error (status 2), before any connection:
    Dask took -1 as a malformed duration, NaN as a unit, and 0 timed out at once."""
    if not (math.isfinite(value) and value > 0):
        raise click.BadParameter(f"{value:g} is not a positive number of seconds")
    return value


def _connection_options(fn: Any) -> Any:
    for option in reversed(
        [
            click.argument("address", required=False),
            click.option(
                "--scheduler-file", default=None, help="the scheduler's file (dask scheduler --scheduler-file)"
            ),
            click.option(
                "--timeout",
                type=float,
                default=10.0,
                show_default=True,
                callback=_positive_seconds,
                help="seconds to reach the scheduler, and for each worker to answer",
            ),
            click.option("--tls-ca-file", default=None, help="CA certificate(s) file for TLS (PEM)"),
            click.option("--tls-cert", default=None, help="client certificate file for TLS (PEM)"),
            click.option("--tls-key", default=None, help="client key file for TLS (PEM)"),
        ]
    ):
        fn = option(fn)
    return fn


@click.group(
    name="gpupool",
    help="dask_gpupool: zero-copy handoffs between same-host workers.",
    context_settings={"help_option_names": ["-h", "--help"]},  # as Dask's own commands; the commands inherit it
)
def gpupool() -> None:
    pass


@gpupool.command(name="demo", help="Start a local cluster with the plugin and show a peer mapping a pool.")
@click.option("--kind", default="auto", type=click.Choice(["auto", "device", "pinned", "host"]), show_default=True)
@click.option("--workers", type=int, default=2, show_default=True, help="workers when there are fewer than two GPUs")
@click.option("--max-size", default="1 GiB", show_default=True, callback=lambda ctx, param, v: _size(v))
def _demo_command(kind: str, workers: int, max_size: str) -> None:
    from dask_gpupool.demo import demo

    sys.exit(demo(kind, max(2, workers), max_size))


def _size(value: str) -> str:
    """``--max-size``, checked as ``gpupool.max-size`` is before any cluster starts."""
    from dask_gpupool.config import Size
    from dask_gpupool.errors import ConfigError

    try:
        Size.parse(value)
    except ConfigError as e:
        raise click.BadParameter(str(e)) from None
    return value


@gpupool.command(name="info", help="Print a running cluster's pool registry and per-worker stats.")
@_connection_options
def _info_command(**options: Any) -> None:
    sys.exit(info(_Target(**options)))


@gpupool.command(name="trim", help="Give pool memory back on every worker (segments retired, free host pages).")
@_connection_options
def _trim_command(**options: Any) -> None:
    sys.exit(trim(_Target(**options)))


def main(argv: list[str] | None = None) -> None:
    """``python -m dask_gpupool`` and the ``dask-gpupool`` script: the ``dask gpupool`` commands.

    The usage text names the command as it was run: click makes ``python -m dask_gpupool`` of ``-m`` and the
    script's own name of a script.
    """
    try:
        try:
            gpupool.main(args=argv)
        finally:
            sys.stdout.flush()  # here, where a closed pipe can still be caught
    except BrokenPipeError:  # the reader went away (``... | head``): stop quietly, as a Unix tool does
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        sys.exit(1)
