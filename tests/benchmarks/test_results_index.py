"""benchmarks/README.md indexes benchmarks/results/: a row per file there, none for a file that is not."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
INDEX = ROOT / "benchmarks" / "README.md"
RESULTS = ROOT / "benchmarks" / "results"
# A row of one of the index's tables: its first cell is the file's name, alone, in backticks.
ROW = re.compile(r"^\|\s*`([^`|]+)`\s*\|(.*)\|\s*$")


def indexed() -> list[tuple[str, list[str]]]:
    rows = []
    for line in INDEX.read_text().splitlines():
        match = ROW.match(line)
        if match:
            rows.append((match.group(1), [cell.strip() for cell in match.group(2).split("|")]))
    return rows


def test_every_result_file_has_a_row() -> None:
    files = {path.name for path in RESULTS.iterdir() if path.is_file()}
    missing = sorted(files - {name for name, _ in indexed()})
    assert not missing, f"not indexed in benchmarks/README.md: {missing}"


def test_every_row_names_a_file_that_exists_once() -> None:
    rows = indexed()
    assert rows, "benchmarks/README.md has no table rows"
    gone = sorted(name for name, _ in rows if not (RESULTS / name).is_file())
    assert not gone, f"indexed in benchmarks/README.md but not in benchmarks/results/: {gone}"
    twice = sorted(name for name, count in Counter(name for name, _ in rows).items() if count > 1)
    assert not twice, f"indexed more than once: {twice}"


def test_every_row_gives_a_command_what_it_shows_and_a_date() -> None:
    for name, cells in indexed():
        assert len(cells) == 3 and all(cells), f"{name}: want file | command | what it shows | date"
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", cells[2]), f"{name}: date {cells[2]!r} is not YYYY-MM-DD"
