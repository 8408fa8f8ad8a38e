from __future__ import annotations

import pathlib
import re
import subprocess
import sys

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


def test_ci_tests_the_oldest_dask_and_distributed_the_package_allows():
    """``.ci/run`` runs tests on ``OLDEST``, which must be the lower bound of both requirements in pyproject.toml."""
    oldest = re.search(r"^OLDEST=(\S+)$", (ROOT / ".ci" / "run").read_text(), re.M)
    assert oldest is not None, ".ci/run sets no OLDEST"
    requirements = re.findall(r'^\s*"((?:dask|distributed)\b[^"]*)",', (ROOT / "pyproject.toml").read_text(), re.M)
    assert sorted(requirements) == [f"dask>={oldest[1]}", f"distributed>={oldest[1]}"], requirements


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


# -- the layers -------------------------------------------------------------------------------------

PACKAGE = ROOT / "dask_gpupool"

#: Lowest first. A module imports (at the top or inside a function) only from its own layer or lower ones.
LAYERS = [
    ("errors", "core"),
    ("config", "tuning"),
    ("wire",),
    ("memory",),
    ("transport",),
    ("handoff",),
    ("ops",),
    ("dask",),
    ("cli", "demo", "__main__", "__init__", "testing"),
]


def _module_imports() -> dict[str, tuple[set[str], set[str]]]:
    """``{module: (imported at the top, imported inside functions)}`` for every module of the package."""
    import ast

    found: dict[str, tuple[set[str], set[str]]] = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(("dask_gpupool", *path.relative_to(PACKAGE).with_suffix("").parts))
        name = name.removesuffix(".__init__")
        top: set[str] = set()
        inner: set[str] = set()

        def visit(node: ast.AST, at_top: bool, top: set[str] = top, inner: set[str] = inner) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                    continue  # for type checkers only
                if isinstance(child, ast.ImportFrom) and (child.module or "").startswith("dask_gpupool"):
                    assert child.module is not None
                    base = child.module
                    targets = [f"{base}.{a.name}" if base == "dask_gpupool" else base for a in child.names]
                    (top if at_top else inner).update(targets)
                elif isinstance(child, ast.Import):
                    (top if at_top else inner).update(a.name for a in child.names if a.name.startswith("dask_gpupool"))
                deeper = at_top and not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
                visit(child, deeper)

        visit(ast.parse(path.read_text()), True)
        found[name] = (top, inner)
    return found


def _layer(module: str) -> int:
    parts = module.split(".")
    first = parts[1] if len(parts) > 1 else "__init__"
    for i, names in enumerate(LAYERS):
        if first in names:
            return i
    raise AssertionError(f"{module} is in no layer: add it to LAYERS")


def test_layers_import_only_downward():
    imports = _module_imports()
    wrong = []
    for module, (top, inner) in imports.items():
        for target in top | inner:
            if target not in imports:
                target = target.rsplit(".", 1)[0]  # `from dask_gpupool import as_array`: the package itself
            if _layer(target) > _layer(module):
                wrong.append(f"{module} -> {target}")
    assert not wrong, "\n".join(sorted(wrong))


def test_no_import_cycle_at_the_top_of_modules():
    imports = {m: {t for t in top if t != m} for m, (top, _inner) in _module_imports().items() if m != "dask_gpupool"}
    done: set[str] = set()

    def walk(m: str, path: list[str]) -> None:
        if m in path:
            raise AssertionError("import cycle: " + " -> ".join([*path[path.index(m) :], m]))
        if m in done or m not in imports:
            return
        for t in imports[m]:
            walk(t, [*path, m])
        done.add(m)

    for m in imports:
        walk(m, [])


def test_no_import_cycle_even_through_imports_inside_functions():
    """An import inside a function hides a cycle from the test above, not from the reader: none in the package."""
    imports = {m: {t for t in top | inner if t != m} for m, (top, inner) in _module_imports().items()}
    imports.pop("dask_gpupool", None)
    done: set[str] = set()

    def walk(m: str, path: list[str]) -> None:
        if m in path:
            raise AssertionError("import cycle: " + " -> ".join([*path[path.index(m) :], m]))
        if m in done or m not in imports:
            return
        for t in imports[m]:
            walk(t, [*path, m])
        done.add(m)

    for m in imports:
        walk(m, [])


def test_no_module_is_over_450_lines():
    """Every module of the package (the library and its test helpers) reads top-down, one concept per module."""
    long = {
        str(p.relative_to(PACKAGE)): n for p in PACKAGE.rglob("*.py") if (n := len(p.read_text().splitlines())) > 450
    }
    assert not long, long


def test_the_library_never_imports_its_test_helpers():
    users = [m for m, (top, inner) in _module_imports().items() if "dask_gpupool.testing" in top | inner]
    assert users == [], users


def test_importing_the_package_loads_no_worker_stack():
    """A client or the scheduler imports dask_gpupool: pools, brokers, links and the service load only on workers."""
    code = (
        "import sys, dask_gpupool; dask_gpupool.GPUPool(kind='host'); "
        "print(sorted(m for m in sys.modules if m.startswith('dask_gpupool')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    loaded = eval(out.stdout)
    worker_stack = ("dask_gpupool.handoff.service", "dask_gpupool.transport.", "dask_gpupool.memory.pool")
    assert not [m for m in loaded if m.startswith(worker_stack)], loaded
