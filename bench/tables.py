"""Plain-text tables for the benchmarks' output."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["print_table"]


def print_table(title: str, header: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    """Prints a titled table: first column left-aligned, the others right-aligned."""
    cells = [[str(c) for c in header]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    print(f"\n{title}")
    for i, row in enumerate(cells):
        padded = [
            c.ljust(w) if j == 0 else c.rjust(w)
            for j, (c, w) in enumerate(zip(row, widths, strict=True))
        ]
        print("  " + "  ".join(padded))
        if i == 0:
            print("  " + "  ".join("-" * w for w in widths))
