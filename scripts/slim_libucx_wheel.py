"""Repack the libucx wheel without what Dask over UCXX never loads, so that the device tool's carry fits.

The device tool carries at most 64 MiB of working tree; ``.whl`` and ``.whl-ucx`` together came to just under it,
and the tool refused them. The libucx wheel is 42 MB, about half of it static libraries (``*.a``), the perftest
plugin and the ``bin/`` tools, none of which UCXX's Python package loads. This writes the wheel again without them
(and without their ``RECORD`` lines), under the same name, moving the original to ``.old/`` (ignored by git, and
not carried: an original left in ``.whl-ucx`` would travel too):

    python3 scripts/slim_libucx_wheel.py .whl-ucx/libucx_cu13-*.whl
"""

from __future__ import annotations

import os
import sys
import zipfile


def dropped(name: str) -> bool:
    return name.endswith((".a", ".la")) or "perftest" in name or name.startswith("libucx/bin/")


def slim(path: str) -> None:
    os.makedirs(".old", exist_ok=True)
    orig = os.path.join(".old", os.path.basename(path))
    if not os.path.exists(orig):
        os.replace(path, orig)
    with zipfile.ZipFile(orig) as zi, zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zo:
        for info in zi.infolist():
            if dropped(info.filename):
                continue
            data = zi.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                lines = data.decode().split("\n")
                data = "\n".join(x for x in lines if not dropped(x.split(",")[0])).encode()
            zo.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
    print(f"{path}: {os.path.getsize(orig):,} -> {os.path.getsize(path):,} bytes")


if __name__ == "__main__":
    for p in sys.argv[1:]:
        slim(p)
