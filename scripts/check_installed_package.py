"""Check an installed (not editable) dask-gpupool against its source tree: ``.ci/run`` runs this.

Usage: ``VENV/bin/python scripts/check_installed_package.py SOURCE_ROOT`` from a directory outside the source tree,
so that ``import dask_gpupool`` finds the installed copy. It checks that

- the package imports from the environment's site-packages, not from ``SOURCE_ROOT``;
- every module of ``SOURCE_ROOT/dask_gpupool`` was installed and imports (the library's own sub-packages and
  ``dask_gpupool.testing``, which the worker processes of the tests import);
- the package data was installed: the defaults file loads into ``dask.config`` and passes the checks of
  ``PoolOptions.from_config``, the schema file parses, ``py.typed`` is there.

The ``dask-gpupool`` script and ``python -m dask_gpupool`` are run by ``.ci/run`` itself.
"""

from __future__ import annotations

import importlib
import pathlib
import sys

import yaml


def source_modules(root: pathlib.Path) -> dict[str, pathlib.Path]:
    """``{dotted name: path relative to the package}`` for every module under ``root/dask_gpupool``."""
    package = root / "dask_gpupool"
    modules = {}
    for path in package.rglob("*.py"):
        relative = path.relative_to(package)
        modules[".".join(("dask_gpupool", *relative.with_suffix("").parts)).removesuffix(".__init__")] = relative
    return modules


def main(root: pathlib.Path) -> None:
    import dask.config

    import dask_gpupool
    from dask_gpupool.config import PoolOptions

    installed = pathlib.Path(dask_gpupool.__file__).resolve().parent
    if installed.is_relative_to(root.resolve()):
        sys.exit(f"dask_gpupool was imported from the source tree ({installed}), not from the installed package")
    modules = source_modules(root)
    missing = sorted(name for name, relative in modules.items() if not (installed / relative).is_file())
    if missing:
        sys.exit(f"modules of the source tree not installed in {installed}: {', '.join(missing)}")
    for name in sorted(modules):
        if name != "dask_gpupool.__main__":  # runs the CLI on import
            importlib.import_module(name)
    assert dask.config.get("gpupool.kind") == "auto", dask.config.get("gpupool")
    PoolOptions.from_config()
    assert "gpupool" in yaml.safe_load((installed / "gpupool-schema.yaml").read_text())["properties"]
    assert (installed / "py.typed").is_file()
    print(f"dask_gpupool installed at {installed}: {len(modules)} modules import, defaults load")


if __name__ == "__main__":
    main(pathlib.Path(sys.argv[1]))
