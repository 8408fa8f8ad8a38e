"""Sphinx directive ``gpupool-config``: the configuration reference, generated from the package's schema.

Reads ``dask_gpupool/gpupool-schema.yaml`` (each key's type, values and description) and
``dask_gpupool/gpupool.yaml`` (the defaults) at build time, so the reference never drifts from the code: no key is
copied by hand into the docs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from docutils import nodes
from docutils.statemachine import StringList
from sphinx.application import Sphinx
from sphinx.util.docutils import SphinxDirective
from sphinx.util.nodes import nested_parse_with_titles

PACKAGE = Path(__file__).resolve().parents[2] / "dask_gpupool"


def _load() -> tuple[dict[str, Any], dict[str, Any]]:
    schema = yaml.safe_load((PACKAGE / "gpupool-schema.yaml").read_text())["properties"]["gpupool"]["properties"]
    defaults = yaml.safe_load((PACKAGE / "gpupool.yaml").read_text())["gpupool"]
    return schema, defaults


def _type_of(entry: dict[str, Any]) -> str:
    if "enum" in entry:
        return "one of " + ", ".join(f"``{value}``" for value in entry["enum"])
    kinds = entry.get("type", "any")
    kinds = kinds if isinstance(kinds, list) else [kinds]
    return " or ".join("null" if kind == "null" else kind for kind in kinds)


def reference_lines(schema: dict[str, Any], defaults: dict[str, Any]) -> list[str]:
    """reStructuredText of the reference: one entry per key, in the schema's order."""
    lines: list[str] = []
    for key, entry in schema.items():
        default = defaults.get(key)
        lines += [
            f".. _config-{key}:",
            "",
            f"``gpupool.{key}``",
            "-" * (len(key) + 12),
            "",
            f"- **type**: {_type_of(entry)}",
            f"- **default**: ``{'null' if default is None else default}``",
            f"- **set it**: ``GPUPool({key.replace('-', '_')}=...)``, "
            f"``DASK_GPUPOOL__{key.upper().replace('-', '_')}``, "
            f"``--gpupool-{key} VALUE`` after ``--preload dask_gpupool``",
            "",
        ]
        lines += [line.rstrip() for line in entry.get("description", "").strip().splitlines()]
        lines.append("")
    return lines


class GpupoolConfig(SphinxDirective):
    """``.. gpupool-config::``: every ``gpupool.*`` key with its type, default, where to set it and its meaning."""

    has_content = False

    def run(self) -> list[nodes.Node]:
        schema, defaults = _load()
        for name in ("gpupool-schema.yaml", "gpupool.yaml"):
            self.env.note_dependency(str(PACKAGE / name))
        container = nodes.container()
        content = StringList(reference_lines(schema, defaults), source=str(PACKAGE / "gpupool-schema.yaml"))
        nested_parse_with_titles(self.state, content, container, self.content_offset)
        return list(container.children)


def setup(app: Sphinx) -> dict[str, Any]:
    app.add_directive("gpupool-config", GpupoolConfig)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
