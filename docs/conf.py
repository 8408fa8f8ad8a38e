"""Sphinx configuration of the dask-gpupool docs (built in CI with warnings as errors)."""

from __future__ import annotations

import dask_gpupool

project = "dask-gpupool"
copyright = "2026, the dask-gpupool authors"
release = version = dask_gpupool.__version__

extensions = [
    "sphinx.ext.autodoc",
    "numpydoc",  # the Dask ecosystem's docstring convention
    "myst_parser",  # the Markdown pages (design, security, performance, ...)
]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
exclude_patterns = ["_build"]
myst_heading_anchors = 3
numpydoc_show_class_members = False
numpydoc_validation_checks: set[str] = set()
autodoc_typehints = "none"  # the numpydoc sections say the types
autodoc_member_order = "bysource"
suppress_warnings = ["myst.xref_missing"]  # links to files of the repository (scripts/, tests/) from the .md pages
html_theme = "alabaster"
html_static_path: list[str] = []
