"""Sphinx configuration of the dask-gpupool docs (built in CI with warnings as errors)."""

from __future__ import annotations

import sys
from pathlib import Path

import dask_gpupool

sys.path.insert(0, str(Path(__file__).parent / "_ext"))

project = "dask-gpupool"
copyright = "2026, the dask-gpupool authors"
release = version = dask_gpupool.__version__

extensions = [
    "sphinx.ext.autodoc",
    "numpydoc",  # the Dask ecosystem's docstring convention
    "myst_parser",  # the Markdown pages
    "gpupool_config",  # the configuration reference, generated from dask_gpupool/gpupool-schema.yaml
]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
exclude_patterns = ["_build", "_ext"]
myst_heading_anchors = 3
numpydoc_show_class_members = False
# Every numpydoc check on the API reference, but: See Also, Examples and Extended Summary sections (optional
# here), the summary-line grammar (SS05, SS06), return-type naming (RT02) and line-placement style (GL01, GL02).
numpydoc_validation_checks: set[str] = {"all", "SA01", "EX01", "ES01", "SS05", "SS06", "RT02", "GL01", "GL02"}
# The dataclasses document their fields as Attributes (they are the constructor's parameters too), and
# dask_setup's signature is click's wrapper (its options are documented as --gpupool-<key> arguments).
numpydoc_validation_exclude = {
    r"dask_gpupool\.PoolOptions$",
    r"dask_gpupool\.PoolRecord$",
    r"dask_gpupool\.dask_setup$",
}
autodoc_typehints = "none"  # the numpydoc sections say the types
autodoc_member_order = "bysource"
suppress_warnings = ["myst.xref_missing"]  # links to files of the repository (scripts/, tests/) from the .md pages
html_theme = "alabaster"
html_static_path: list[str] = []
