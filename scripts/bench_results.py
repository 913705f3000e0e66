"""Writing a benchmark's rows: one place for the CSV the benchmark scripts leave beside their printed tables."""

from __future__ import annotations

import csv
from pathlib import Path


def write_csv(path: Path, rows: list[dict], fieldnames: list[str] | None = None) -> None:
    """`rows` (dicts) as CSV at `path`, its folder made; the columns are `fieldnames`, else the first row's keys."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fieldnames or list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
