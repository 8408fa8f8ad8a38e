"""Tracked text says what the software does and why, never how or when it was built.

History lives in git and in CHANGELOG.md. A figure is cited by machine, date and package version or commit, never
by the work period that produced it (the phrases below list what counts as such).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve().relative_to(ROOT).as_posix()

#: Suffixes never read: data and pictures (their names are still checked).
SKIPPED_SUFFIXES = (".json", ".png", ".svg", ".jpg", ".gif", ".whl", ".tgz", ".gz")

_UNITS = "first|second|third|fourth|fifth|sixth|seventh|eighth|ninth"
#: Ordinals from the eleventh on: words that only ever counted work periods here ("the thirteenth").
LATE_ORDINAL = (
    r"\b(?:eleventh|twelfth|thirteenth|fourteenth|fifteenth|sixteenth|seventeenth|eighteenth|nineteenth"
    rf"|twentieth|thirtieth|fortieth|(?:twenty|thirty|forty)[-\s](?:{_UNITS}))\b"
)

#: Each pattern with what it catches; matched case-insensitively line by line.
PATTERNS: dict[str, str] = {
    "an ordinal that counts work periods": LATE_ORDINAL,
    "an ordinal session": rf"\b(?:{_UNITS}|tenth|this|next|last|that|previous|earlier|later|same)\s+sess" + r"ions?\b",
    "a work session": r"\bsess" + r"ions?\b",
    "an issue number": r"\bissues?\s+#?\d+",
    "a numbered run of a machine": r"\bcal" + r"ls?\s+\d+\b",
    "a machine withheld": r"\bnot\s+le" + r"nt\b",
    "a change dated by a commit": r"\b(?:since|until|before|after)\s+(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b",
    "a review": r"\breviewers?\b|\bfound\s+by\s+(?:a\s+|the\s+|two\s+|three\s+)?reviews?\b",
}

#: Legitimate uses of the same words, removed from a line before it is matched.
ALLOWED = [
    r"""scope\s*=\s*["']session["']""",  # pytest's fixture scope
    r"\b(?:HTTP|TLS|SSL|pytest|test|process|login|user)\s+sessions?\b",  # protocol, test-runner and OS sessions
    r"(?:\.|\bclass\s+\w*)Session\b|\bSession\s*\(",  # classes named Session (requests, aiohttp, ...)
]

_COMPILED = {what: re.compile(pattern, re.I) for what, pattern in PATTERNS.items()}
_ALLOWED = [re.compile(pattern, re.I) for pattern in ALLOWED]


def tracked_files() -> list[str]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True)
    return [name for name in out.stdout.decode().split("\0") if name]


def narration_in(text: str) -> list[tuple[int, str, str]]:
    """``(line number, what, the matched words)`` for every piece of narration in ``text``."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        for allowed in _ALLOWED:
            line = allowed.sub(" ", line)
        for what, pattern in _COMPILED.items():
            match = pattern.search(line)
            if match:
                found.append((number, what, match.group(0)))
    return found


def text_of(path: Path) -> str | None:
    data = path.read_bytes()
    if b"\0" in data[:8192]:
        return None  # binary
    return data.decode("utf-8", errors="replace")


@pytest.mark.parametrize(
    "line, caught",
    [
        ("as the fifteenth session found", True),
        ("in the twenty-third session, on one H100", True),
        ("run it again next session", True),
        ("results of this session", True),
        ("Two sessions later", True),
        ("see issue 19 and issue #4", True),
        ("(call 4)", True),
        ("calls 5-7 on one H100", True),
        ("`nvidia-h200-x2` was not lent", True),
        ("the default since f52af5b", True),
        ("found by a review of the leases", True),
        ("the thirteenth", True),
        ('@pytest.fixture(scope="session")', False),
        ("an HTTP session to the dashboard", False),
        ("s = requests.Session()", False),
        ("class ClientSession:", False),
        ("the first worker, the third value", False),
        ("package code c964ff0 on one H100 (2026-11-25)", False),
        ("a tenth of the memory", False),
        ("each call to allocate", False),
        ("the recall of 3 values", False),
    ],
)
def test_the_patterns_catch_narration_and_only_narration(line, caught):
    assert bool(narration_in(line)) is caught, narration_in(line)


def test_no_tracked_file_name_narrates():
    bad = [name for name in tracked_files() if narration_in(Path(name).name.replace("-", " ").replace("_", " "))]
    assert bad == []


#: The documentation (the README, the changelog, the docs site, the probes, the plot script and the results): no
#: narration, ever.
DOCUMENTATION = (
    "README.md",
    "CHANGELOG.md",
    "docs/",
    "scripts/probes/",
    "scripts/plot_results.py",
    "benchmarks/results/",
)


def narration_in_files(names: list[str]) -> list[str]:
    found = []
    for name in names:
        if name == HERE or name.endswith(SKIPPED_SUFFIXES):
            continue
        path = ROOT / name
        if not path.is_file():
            continue
        text = text_of(path)
        if text is None:
            continue
        found += [f"{name}:{number}: {what}: {words!r}" for number, what, words in narration_in(text)]
    return found


def test_no_documentation_narrates():
    assert narration_in_files([name for name in tracked_files() if name.startswith(DOCUMENTATION)]) == []


def test_no_tracked_text_narrates():
    """Every tracked text file (code, tests, benchmarks, scripts, docs), data and pictures aside."""
    found = narration_in_files(tracked_files())
    assert found == [], "\n".join(found)
