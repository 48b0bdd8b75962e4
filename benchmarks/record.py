"""What a benchmark measured, in a form the benchmarks page is written from.

Each script prints its figures for a reader and, given ``--record FILE``, appends one JSON line per
table row to FILE: the row's label, its figures as numbers with their format, the text the figures
fill in, the ratio against the reference, the target and whether it was met. ``write_page.py`` runs
the scripts, reads these lines back and writes docs/benchmarks.md, so no figure on that page is
typed by hand.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass
class Row:
    """One row of the benchmarks table.

    ``figures`` maps a name to ``(value, format spec)``; ``text`` and ``ratio`` are ``str.format``
    templates over those names (``"plain loop {plain_ms} ms/step"``), filled with the formatted value
    of one run or with the range over several runs. ``met`` is None where the row has no target.
    """

    label: str
    script: str
    figures: dict[str, tuple[float, str]]
    text: str
    ratio: str = ""
    target: str = ""
    met: bool | None = None

    def __post_init__(self):
        # NumPy's scalars (a comparison of NumPy floats gives numpy.bool_) are not JSON: plain values.
        self.figures = {name: (float(value), str(spec)) for name, (value, spec) in self.figures.items()}
        self.met = None if self.met is None else bool(self.met)


def add_record_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--record", type=Path, default=None, metavar="FILE",
                        help="also append the table rows (JSON lines) to FILE, for benchmarks/write_page.py")


def record(path: Path | None, *rows: Row) -> None:
    """Append ``rows`` to ``path`` as JSON lines, all or none; nothing when ``path`` is None.

    A script calls it once, at its end, with every row: a script that fails on the way records
    nothing, and the page refuses it rather than print a table with rows missing.
    """
    if path is None:
        return
    text = "".join(json.dumps(asdict(row)) + "\n" for row in rows)
    with Path(path).open("a", encoding="utf-8") as out:
        out.write(text)


def read_rows(path: Path) -> list[Row]:
    rows = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if line.strip():
            data = json.loads(line)
            rows.append(Row(**data))
    return rows


def _span(values: list[float], spec: str) -> str:
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return "n/a"
    low, high = format(min(finite), spec), format(max(finite), spec)
    return low if low == high else f"{low}-{high}"


def merge_runs(runs: list[Row]) -> dict:
    """One table row from the same row of several runs: each figure as its value or its range
    (lowest-highest), and whether the target was met on every run, on none or on some."""
    first = runs[0]
    spans = {name: _span([run.figures[name][0] for run in runs], spec) for name, (_, spec) in first.figures.items()}
    met_runs = [run.met for run in runs if run.met is not None]
    if not met_runs:
        met = ""
    elif all(met_runs):
        met = "yes"
    elif not any(met_runs):
        met = "no"
    else:
        met = f"on {sum(met_runs)} of {len(met_runs)} runs"
    return {"label": first.label, "script": first.script, "figures": first.text.format(**spans),
            "ratio": first.ratio.format(**spans) if first.ratio else "", "target": first.target, "met": met}
