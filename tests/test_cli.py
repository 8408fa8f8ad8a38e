"""``dask gpupool info|trim`` and ``python -m dask_gpupool info|trim``: what they print, the scheduler file
and TLS options, and bad input as one line and status 2."""

from __future__ import annotations

import os
import subprocess
import time

import pytest
from conftest import (
    PLUGIN,
    cli,
    free_port,
    nanny_cluster,
    worker_addresses,
)

import dask_gpupool

MiB = 1 << 20


def test_info_and_trim_commands_print_the_registry_and_stats():
    from conftest import warm_up

    with nanny_cluster([{}, {}], PLUGIN) as c:
        a, b = worker_addresses(c)
        warm_up(c, a, b)
        out = cli("info", c.scheduler.address)
        assert out.returncode == 0, out.stderr
        assert "2 pool(s)" in out.stdout and a in out.stdout and b in out.stdout
        assert "zero-copy in" in out.stdout and "host" in out.stdout and "segments" in out.stdout
        # trim: host pools have no segments, so it retires nothing and says so per worker
        out = cli("trim", c.scheduler.address)
        assert out.returncode == 0, out.stderr
        assert a in out.stdout and b in out.stdout and "retiring" in out.stdout
        for w, t in dask_gpupool.trim(c).items():
            assert (t["retire_below"], t["segments"], t["segments_retiring"]) == (0, 0, 0), (w, t)


def test_dask_gpupool_commands_take_a_scheduler_file_tls_and_report_a_bad_address_in_one_line(tmp_path):
    """`dask gpupool info|trim` (Dask's own command, through the dask_cli entry point): an address or
    --scheduler-file, Dask's TLS options; an unreachable scheduler is one line and status 2; a closed pipe
    is no traceback."""
    import json
    import sys

    from distributed.security import Security

    pytest.importorskip("cryptography", reason="Security.temporary needs cryptography")
    dask_cmd = [sys.executable, "-m", "dask", "gpupool"]
    out = subprocess.run([*dask_cmd, "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "info" in out.stdout and "trim" in out.stdout
    security = Security.temporary()
    files = {}
    for name, pem in (
        ("ca", security.tls_ca_file),
        ("cert", security.tls_client_cert),
        ("key", security.tls_client_key),
    ):
        files[name] = tmp_path / f"{name}.pem"
        files[name].write_text(pem)
    tls = ["--tls-ca-file", str(files["ca"]), "--tls-cert", str(files["cert"]), "--tls-key", str(files["key"])]
    with nanny_cluster([{}, {}], PLUGIN, security=security) as c:
        address = c.scheduler.address
        assert address.startswith("tls://")
        scheduler_file = tmp_path / "scheduler.json"
        scheduler_file.write_text(json.dumps({"address": address, "type": "Scheduler"}))
        out = subprocess.run(
            [*dask_cmd, "info", "--scheduler-file", str(scheduler_file), *tls],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0, out.stderr
        assert "2 pool(s)" in out.stdout
        out = subprocess.run([*dask_cmd, "trim", address, *tls], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0 and "retiring" in out.stdout, out.stderr
        closed = subprocess.run(  # `true` reads nothing and is gone before the first line is written
            f"{sys.executable} -m dask_gpupool info {address} {' '.join(tls)} | true",
            shell=True,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert "Traceback" not in closed.stderr and "BrokenPipe" not in closed.stderr, closed.stderr
    port = free_port()
    out = cli("info", f"tcp://127.0.0.1:{port}", "--timeout", "1")
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.strip().startswith(f"cannot reach tcp://127.0.0.1:{port}") and "Traceback" not in out.stderr
    out = cli("info")
    assert out.returncode == 2 and "give the scheduler's ADDRESS or --scheduler-file" in out.stderr


def test_info_command_on_a_cluster_without_the_plugin_says_so():
    with nanny_cluster([{}]) as c:
        out = cli("info", c.scheduler.address)
        assert out.returncode == 2 and "no gpupool registry" in out.stderr


def one_line_exit_2(*args: str, within: float = 30.0) -> str:
    """``python -m dask_gpupool ARGS`` must fail at once with status 2 and one line on stderr; that line."""
    import sys

    t0 = time.monotonic()
    try:
        out = subprocess.run(
            [sys.executable, "-m", "dask_gpupool", *args], capture_output=True, text=True, timeout=within
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"{args}: still running after {within} s")
    took = time.monotonic() - t0
    assert out.returncode == 2 and out.stdout == "", (args, out.returncode, out.stdout, out.stderr)
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1, (args, out.stderr)
    assert took < within, (args, took)
    return out.stderr.strip()


@pytest.mark.parametrize("timeout", ["-1", "0", "nan", "-inf"])
def test_a_timeout_that_is_not_a_positive_number_of_seconds_is_a_usage_error(timeout):
    """``--timeout -1`` reached Dask as ``-1`` and came back as "could not convert string to float: '1-1.0'",
    ``nan`` as a traceback (``KeyError: 'Invalid time unit: nan'``), and 0 timed out at once: each is click's usage
    error now, status 2, before any connection."""
    for command in ("info", "trim"):
        out = cli(command, f"tcp://127.0.0.1:{free_port()}", "--timeout", timeout)
        assert out.returncode == 2 and out.stdout == "", (out.stdout, out.stderr)
        assert "Traceback" not in out.stderr and "Invalid value for '--timeout'" in out.stderr, out.stderr
        assert "cannot reach" not in out.stderr


def test_the_console_script_names_itself_in_its_usage():
    """``dask-gpupool --help`` said ``Usage: python -m dask_gpupool``; ``python -m dask_gpupool`` still says that."""
    import shutil
    import sys

    script = shutil.which("dask-gpupool", path=os.path.dirname(sys.executable))
    if script is None:
        pytest.skip("the dask-gpupool script is not installed beside this Python (pip install -e .)")
    out = subprocess.run([script, "info", "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.startswith("Usage: dask-gpupool info "), out.stdout + out.stderr
    out = cli("info", "--help")
    assert out.returncode == 0 and out.stdout.startswith("Usage: python -m dask_gpupool info "), out.stdout


def test_dash_h_is_help_as_in_dask_own_commands():
    """``python -m dask_gpupool -h`` (and of each command) prints the help, as ``dask scheduler -h`` does."""
    for args in (("-h",), ("info", "-h"), ("demo", "-h")):
        out = cli(*args)
        assert out.returncode == 0 and out.stdout == cli(*args[:-1], "--help").stdout, (args, out.stderr)
        assert out.stdout.startswith("Usage: python -m dask_gpupool"), out.stdout


def test_a_scheduler_file_that_is_missing_or_not_one_is_one_line_and_status_2(tmp_path):
    """``--scheduler-file``: a file that does not appear within ``--timeout`` (Dask's Client waits for it for
    ever), or one that holds no scheduler address (the Client raised ``AssertionError`` after ten reads), is one
    line and status 2, like an unreachable scheduler."""
    missing = tmp_path / "nowhere.json"
    line = one_line_exit_2("info", "--scheduler-file", str(missing), "--timeout", "1")
    assert str(missing) in line and "no such file" in line
    for name, text in (("garbage.json", "garbage"), ("empty.json", "{}"), ("number.json", '{"address": 7}')):
        bad = tmp_path / name
        bad.write_text(text)
        line = one_line_exit_2("trim", "--scheduler-file", str(bad), "--timeout", "1")
        assert str(bad) in line and "no scheduler address" in line


def test_tls_options_that_cannot_work_are_one_line_and_status_2(tmp_path):
    """TLS options with a ``tcp://`` address (Dask's ``RuntimeError``: encryption required), a CA file that does
    not exist, or a key without a certificate (Dask's ``TypeError``: no ``ssl_context``) are one line and status
    2, not a traceback followed by the half-started client's own one at exit."""
    from distributed.security import Security

    pytest.importorskip("cryptography", reason="Security.temporary needs cryptography")
    security = Security.temporary()
    ca, cert, key = tmp_path / "ca.pem", tmp_path / "cert.pem", tmp_path / "key.pem"
    ca.write_text(security.tls_ca_file)
    cert.write_text(security.tls_client_cert)
    key.write_text(security.tls_client_key)
    tls = ["--tls-ca-file", str(ca), "--tls-cert", str(cert), "--tls-key", str(key)]
    port = free_port()
    line = one_line_exit_2("info", f"tcp://127.0.0.1:{port}", *tls)
    assert "tls://" in line
    pem = tmp_path / "not-a-cert.pem"
    pem.write_text("not a certificate")
    missing = tmp_path / "missing-ca.pem"
    line = one_line_exit_2("info", f"tls://127.0.0.1:{port}", "--tls-ca-file", str(missing), "--tls-cert", str(pem))
    assert "TLS" in line
    line = one_line_exit_2("trim", f"tls://127.0.0.1:{port}", "--tls-key", str(pem))
    assert "--tls-ca-file" in line and "--tls-cert" in line


def test_an_address_that_is_not_one_is_one_line_and_status_2():
    """An unknown scheme, a missing port or an unparsable address was one line, then the half-started client's
    ``TimeoutError`` traceback at exit, twice ``--timeout`` later."""
    for address in ("foo://127.0.0.1:8786", "127.0.0.1", "notanaddress:::"):
        line = one_line_exit_2("info", address, "--timeout", "5", within=9)
        assert line.startswith(f"cannot reach {address}: ") and "address" in line
