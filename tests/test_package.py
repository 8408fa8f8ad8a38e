from __future__ import annotations

import pathlib
import re

import pytest

import dask_gpupool

ROOT = pathlib.Path(__file__).parent.parent


def test_public_names_are_pinned():
    assert sorted(dask_gpupool.__all__) == [
        "BrokerError",
        "BrokerRefusedError",
        "ConfigError",
        "DataLostError",
        "GPUPool",
        "GPUPoolError",
        "NotAMemberError",
        "PeerAccessError",
        "PeerLostError",
        "PoolClosedError",
        "PoolExhaustedError",
        "PoolOptions",
        "PoolRecord",
        "PoolUnavailableError",
        "ProtocolError",
        "UnknownPoolError",
        "allocate",
        "as_array",
        "dask_setup",
        "pool_stats",
        "pools",
        "stats",
        "to_pool",
        "trim",
    ]


def test_every_error_derives_from_the_base_and_a_builtin():
    errors = [getattr(dask_gpupool, n) for n in dask_gpupool.__all__ if n.endswith("Error")]
    for e in errors:
        assert issubclass(e, dask_gpupool.GPUPoolError)
        builtins = [b for b in e.__mro__ if b.__module__ == "builtins" and b not in (Exception, BaseException, object)]
        assert e is dask_gpupool.GPUPoolError or builtins, f"{e.__name__} is no builtin error (ValueError, ...)"


def test_allocate_outside_a_worker_is_a_clear_error():
    with pytest.raises(dask_gpupool.PoolUnavailableError, match="not running on a Dask worker"):
        dask_gpupool.allocate(10)


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    commands = re.findall(r"```bash\n(.+?)\n```", readme)
    assert len(commands) == 2, "the README has exactly two commands"
    assert commands[1] in (ROOT / ".ci" / "run").read_text()


def test_zero_copy_example_runs():
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "zero_copy_handoff.py")],
        capture_output=True,
        text=True,
        timeout=170,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    assert out.stdout.rstrip().endswith("OK") and "copied in 0 bytes" in out.stdout


def test_etl_example_runs_small_on_host_pools(tmp_path):
    import subprocess
    import sys

    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples" / "etl_pipeline.py"),
            "--size",
            "8MiB",
            "--chunks",
            "6",
            "--plot",
            str(tmp_path / "etl.png"),
        ],
        capture_output=True,
        text=True,
        timeout=170,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    assert out.stdout.rstrip().endswith("OK")
    line = next(x for x in out.stdout.splitlines() if x.startswith("dask_gpupool: zero-copy"))
    assert "zero-copy 0 B" not in line  # chunks did cross between workers zero-copy
    assert "plain Dask: every transfer is Dask's own (no plugin, nothing counted)" in out.stdout
