"""The README's and the quickstart's code runs as written (issue 20: docs that run)."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def readme_use() -> str:
    text = (ROOT / "README.md").read_text()
    return re.search(r"## Use\n\n```python\n(.*?)```", text, re.S).group(1)


def quickstart_first() -> str:
    text = (ROOT / "docs" / "quickstart.rst").read_text()
    block = re.search(r"\.\. code-block:: python\n\n(.*?)\n(?=\S)", text, re.S).group(1)
    return textwrap.dedent(block)


@pytest.mark.parametrize("snippet", [readme_use, quickstart_first], ids=["readme-use", "quickstart"])
def test_the_snippet_runs_and_hands_over_zero_copy(snippet, tmp_path):
    script = tmp_path / "snippet.py"
    script.write_text(snippet())
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "16777216.0" in out.stdout
    zero_copy = [int(n) for n in re.findall(r"'zero_copy_bytes': (\d+)", out.stdout)]
    assert max(zero_copy) >= 8 << 24, out.stdout  # the consumer mapped the 128 MiB array


def test_the_readme_demo_runs_without_a_gpu_and_hands_over_zero_copy():
    """The README's first command: `python -m dask_gpupool demo` (host pools without a GPU, GPUs when present)."""
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("DASK_GPUPOOL")}
    out = subprocess.run(
        [sys.executable, "-m", "dask_gpupool", "demo"], capture_output=True, text=True, timeout=150, env=env
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.rstrip().endswith("OK"), out.stdout
    assert "zero-copy bytes received: 1,048,576, copied: 0" in out.stdout, out.stdout
