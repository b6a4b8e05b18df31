"""The README's figures name their results files, and each figure is in the file it names.

- Every file the README names exists (under docs/results/, the repository root, or docs/), so a number
  cannot point at a file that was never committed.
- Every row of the "Measured" table that quotes a figure names a results file (one under docs/results/
  or benchmarks/results/).
- Every table row or sentence that names a results file quotes only figures that file holds: a figure
  with d decimals matches a number of the file within half a unit of its last digit (1,304 for 1303.5,
  70 for 69.61, 38% for 0.3756). A ratio (55, then a multiplication sign) or a share (13%) may instead
  be the quotient of two other figures of the same cell. The first cell of a row says what was measured
  (shape, tokens, concurrency) and is not checked; numbers glued to letters (H200, p50, fp16, 0.5B) and
  text in backticks are names, not figures.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIRS = (ROOT / "docs" / "results", ROOT / "benchmarks" / "results")

_NAMED = re.compile(r"`([A-Za-z0-9_./-]+\.(?:json|md|png))`")
_BACKTICKS = re.compile(r"`[^`]*`")
# A figure: digits with optional thousands separators and decimals, not glued to a letter, digit or
# dot on either side; an optional unit right after it (TIMES or %), or after a range's dash (1.01-1.21).
TIMES = "\N{MULTIPLICATION SIGN}"
EN_DASH = "\N{EN DASH}"
_FIGURE = re.compile(
    r"(?<![A-Za-z0-9_.,])(\d{1,3}(?:,\d{3})+|\d+)(\.\d+)?(?![A-Za-z0-9_]|\.\d)"
    rf"(?:([{TIMES}%])|(?=[-{EN_DASH}]\d[\d,.]*([{TIMES}%])))?"
)
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")


@dataclass(frozen=True)
class Figure:
    """One number quoted in the README: its value, its decimals and its unit ("", TIMES or "%")."""

    text: str
    value: float
    decimals: int
    unit: str

    def near(self, x: float) -> bool:
        """Whether `x` rounds to this figure at the figure's own precision."""
        return abs(x - self.value) <= 0.5 * 10.0**-self.decimals * (1 + 1e-9) + 1e-12


def figures(text: str) -> list[Figure]:
    """The figures of a piece of README text (backtick spans left out)."""
    out = []
    for m in _FIGURE.finditer(_BACKTICKS.sub(" ", text)):
        whole, frac, unit, range_unit = m.group(1), m.group(2) or "", m.group(3), m.group(4)
        out.append(
            Figure(
                m.group(0),
                float(whole.replace(",", "") + frac),
                max(len(frac) - 1, 0),
                unit or range_unit or "",
            )
        )
    return out


def results_file(name: str) -> Path | None:
    """The results file a README name points at, or None when it is no results file."""
    if not name.endswith((".json", ".md")):
        return None
    for base in (*RESULTS_DIRS, ROOT):
        path = base / name
        if path.is_file() and any(d in path.resolve().parents for d in RESULTS_DIRS):
            return path
    return None


def _walk(value: object) -> Iterator[float]:
    if isinstance(value, bool):
        return
    if isinstance(value, int | float):
        if math.isfinite(value):
            yield float(value)
    elif isinstance(value, str):
        yield from (float(n) for n in _NUMBER.findall(value))
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _walk(str(k))
            yield from _walk(v)
    elif isinstance(value, list):
        for v in value:
            yield from _walk(v)


def numbers_of(path: Path) -> list[float]:
    """Every number a results file holds: JSON values and keys, or the numbers of a Markdown text."""
    if path.suffix == ".json":
        return list(_walk(json.loads(path.read_text())))
    return [
        float(n.replace(",", ""))
        for n in re.findall(r"\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?", path.read_text())
    ]


def unmatched(cell: str, numbers: list[float]) -> list[str]:
    """The figures of one cell that neither the numbers of its files nor the cell's other figures give."""
    found = figures(cell)
    scale = {"": 1.0, TIMES: 1.0, "%": 100.0}
    bad = []
    for f in found:
        if any(f.near(x * scale[f.unit]) for x in numbers):
            continue
        others = [g.value for g in found if g is not f and g.value > 0]
        if f.unit and any(f.near(a / b * scale[f.unit]) for a in others for b in others if a is not b):
            continue
        bad.append(f.text)
    return bad


def table_rows(text: str) -> Iterator[tuple[str, list[str]]]:
    """(section heading, cells) for each body row of each Markdown table of `text`."""
    section = ""
    for line in text.splitlines():
        if line.startswith("#"):
            section = line.lstrip("#").strip()
        elif line.startswith("|") and not re.fullmatch(r"[|\s:-]+", line):
            yield section, [c.strip() for c in line.strip().strip("|").split("|")]


def sentences(text: str) -> Iterator[str]:
    """The sentences of the README's prose: tables and code blocks left out."""
    prose, fenced = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and not line.startswith(("|", "#")):
            prose.append(line)
    for paragraph in "\n".join(prose).split("\n\n"):
        yield from re.split(r"(?<=[.!?])\s+(?=[A-Z`(])", " ".join(paragraph.split()))


def check(text: str) -> list[str]:
    """Every problem of a README text: a Measured row naming no results file, or a figure not in its file."""
    problems = []
    units: list[tuple[str, list[str]]] = []
    for section, cells in table_rows(text):
        named = [p for n in _NAMED.findall(" ".join(cells)) if (p := results_file(n))]
        if section == "Measured" and not named and any(figures(c) for c in cells[1:]):
            problems.append(f"row {cells[0]!r} quotes figures but names no results file")
        units.append((cells[0], cells[1:]))
    units.extend((s, [s]) for s in sentences(text))
    for label, cells in units:
        paths = [p for n in _NAMED.findall(" ".join(cells)) if (p := results_file(n))]
        if not paths:
            continue
        numbers = [x for p in paths for x in numbers_of(p)]
        for cell in cells:
            if bad := unmatched(cell, numbers):
                names = ", ".join(p.name for p in paths)
                problems.append(f"{label[:60]!r}: {bad} not in {names}")
    return problems


def test_every_results_file_the_readme_names_exists() -> None:
    text = (ROOT / "README.md").read_text()
    named = sorted(set(_NAMED.findall(text)))
    assert named, "the README names no results files"
    missing = [
        n
        for n in named
        if not any((base / n).is_file() for base in (ROOT, ROOT / "docs" / "results", ROOT / "docs"))
    ]
    assert not missing, f"the README names files that do not exist: {missing}"


def test_every_readme_figure_is_in_the_results_file_it_names() -> None:
    text = (ROOT / "README.md").read_text()
    assert any(s == "Measured" for s, _ in table_rows(text)), "the README has no Measured table"
    problems = check(text)
    assert not problems, "\n".join(problems)


_OVERHEAD = ROOT / "docs" / "results" / "serving-cpu-overhead.json"


@pytest.mark.parametrize(
    ("cell", "numbers", "bad"),
    [
        # The figures issue 21 found (the file: 4.1 / 29.5, 12.8 / 162, 15.2 times; 13 is 12.8 rounded).
        ("p50 3.9 / 23 ms, p99 13 / 142 ms", None, ["3.9", "23", "142"]),
        (f"p50 4.1 / 29.5 ms, p99 12.8 / 162 ms, 15.2{TIMES} one bare RPC's", None, []),
        # A share in the file is a fraction of 1.
        ("verifying is 38% / 32%", [0.3756, 0.3213], []),
        ("verifying is 37% / 32%", [0.3756, 0.3213], ["37%"]),
        # Ratios and shares of the cell's own figures.
        (f"66.6 vs 1.22 ms: 55{TIMES}, 54.6{TIMES}; 10 of 76 (13%)", [66.552, 1.222, 10, 76], []),
        (f"66.6 vs 1.22 ms: 56{TIMES}; 10 of 76 (14%)", [66.552, 1.222, 10, 76], [f"56{TIMES}", "14%"]),
        (f"1.01-1.21{TIMES} of 4,145 / 4,111 and 6,611 / 5,456", [4145.3, 4111.0, 6611.4, 5456.0], []),
        (f"1.02-1.21{TIMES} of 4,145 / 4,111 and 6,611 / 5,456", [4145.3, 4111.0, 6611.4, 5456.0], ["1.02"]),
    ],
)
def test_the_check_catches_a_figure_its_file_does_not_hold(
    cell: str, numbers: list[float] | None, bad: list[str]
) -> None:
    assert unmatched(cell, numbers_of(_OVERHEAD) if numbers is None else numbers) == bad


def test_a_measured_row_without_a_results_file_is_a_problem() -> None:
    text = "## Measured\n\n| what | result |\n|---|---|\n| engine tok/s | 1,182 / 3,379 |\n"
    assert check(text) == ["row 'engine tok/s' quotes figures but names no results file"]
    named = text.replace("3,379 |", "3,379 (`serving-cpu-overhead.json`) |")
    assert check(named) == ["'engine tok/s': ['1,182', '3,379'] not in serving-cpu-overhead.json"]
