"""The README's figures name their results files: every file it names exists (under docs/results/, the
repository root, or docs/), so a number cannot point at a file that was never committed."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_results_file_the_readme_names_exists() -> None:
    text = (ROOT / "README.md").read_text()
    named = sorted(set(re.findall(r"`([A-Za-z0-9_./-]+\.(?:json|md|png))`", text)))
    assert named, "the README names no results files"
    missing = [
        n
        for n in named
        if not any((base / n).is_file() for base in (ROOT, ROOT / "docs" / "results", ROOT / "docs"))
    ]
    assert not missing, f"the README names files that do not exist: {missing}"
