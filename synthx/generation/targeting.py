"""How many synthetic tumors SynthX should make per (sex, age band, phase) cell (the cells and their
counts: :mod:`synthx.generation.cells`).

The allocation starts from the TRAINING split's positive (tumor) real cases, counted per cell of
the grid sex x age band x phase (the subgroups of docs/explanation/detection-and-statistics.md "Subgroups"). A case whose sex,
age or phase is Unknown belongs to no cell: Unknown is a value, never a guess, so it is neither
counted nor requested. No rule reads the test split. The rules:

- ``need:B``: spend a budget of ``B`` synthetic cases where the baseline fails: in proportion to
  each cell's need, the sum over its three attributes (sex, age band, phase) of the deficit of the
  cell's value: how far the baseline's VALIDATION miss rate (1 - sensitivity) there exceeds the
  attribute's pooled miss rate (0 when it does not, or when the value has no validation
  positives; :func:`cell_deficits`). Each subgroup's share is split evenly over its cells with a
  canvas, so a gap gets its share however few fillable cells it has (:func:`plan_need`). Only cells holding at least one
  canvas (a healthy real training scan of that cell) receive cases, since the others cannot be
  filled. Needs the baseline's per-case validation records (``label``, ``sex``, ``age_band``,
  ``phase`` and ``prediction`` or a score column, as the evaluation callback writes them); a record
  of a case outside the validation split is refused.
- ``min_positives:k``: bring every cell to at least ``k`` positives, ``requested = max(0, k - count)``.
- ``match:<distribution>`` (``match:val``, ``match:uniform`` or ``match:<table>``): spend a total
  budget ``B`` so that the training positives' distribution over cells comes as close as it can to
  the target distribution ``p``. With real counts ``c_i`` the request is ``r_i = max(0, p_i * T - c_i)``,
  with the level ``T`` chosen so that ``sum r_i = B`` (water filling). When ``B`` is large enough,
  ``T = C + B`` and the match is exact. As for ``need``, only cells with a canvas take part (the
  others are marked ``unfillable``). ``match:test`` is refused: test labels must not shape training.
- ``counts:<file>`` (or just a ``.csv``/``.yaml`` path): explicit counts from a table with columns
  ``sex, age_band, phase, requested``.

Real-valued requests are rounded to integers that sum exactly to ``B`` by largest remainders, ties
going to the earlier cell; the arithmetic is exact (fractions). The result is a table
``(sex, age_band, phase, real_positives, requested)`` (``need`` and ``match`` add ``canvases`` and
``unfillable``: wanted but without a canvas; ``need`` adds ``need``), one
row per cell in a stable order (sex F, M; age bands youngest first; phases non-contrast, arterial,
venous, delayed).

Example::

    targets = resolve_targets("data/phantom", "splits/phantom.csv", "min_positives:4")
    targets = resolve_targets("data/phantom", "splits/phantom.csv", "need:40", baseline_records=val_records, threshold=50.0)
    targets = resolve_targets("data/phantom", "splits/phantom.csv", "need:40", baseline_records=val_records,
                              detection=recipe.detection)  # the segmentation recipe's m and score
"""

from __future__ import annotations

from collections import Counter
from fractions import Fraction
from pathlib import Path
from typing import Mapping, Sequence

import pandas as pd

from lightning_modules.config.recipe import DetectionConfig, DetectionScore
from lightning_modules.data.cohort import Cohort, load_cohort
from lightning_modules.data.metadata import AGE_BAND_NAMES, PHASES, SEXES, UNKNOWN
from lightning_modules.data.splits import SPLITS as SPLIT_NAMES
from lightning_modules.data.splits import load_split
from synthx.generation.cells import (CELL_COLUMNS, TARGET_COLUMNS, TargetingError, cell_grid, count_canvases,
                                     count_positives, labelled_cases, read_cell)


def plan_min_positives(train_counts: pd.DataFrame, k: int) -> pd.DataFrame:
    """``requested = max(0, k - real_positives)`` for every cell.

    Args:
        train_counts: the grid with the training positives in ``count`` (see :func:`count_positives`).
        k: the least number of positives each cell should hold after augmentation.
    """
    if k < 0:
        raise TargetingError(f"min_positives needs k >= 0, got {k}")
    table = _base_table(train_counts)
    table["requested"] = [max(0, k - int(c)) for c in table["real_positives"]]
    return table


def plan_match(train_counts: pd.DataFrame, target_weights: Sequence, budget: int) -> pd.DataFrame:
    """Spend ``budget`` synthetic cases so the training positives move towards a target distribution.

    Args:
        train_counts: the grid with the training positives in ``count``.
        target_weights: one non-negative weight per cell of ``train_counts`` (in its order), e.g.
            the test split's positive counts; normalized here.
        budget: the total number of synthetic cases to request.
    """
    if budget < 0:
        raise TargetingError(f"the synthetic budget must be >= 0, got {budget}")
    weights = [Fraction(w) if not isinstance(w, float) else Fraction(str(w)) for w in target_weights]
    if len(weights) != len(train_counts):
        raise TargetingError(f"{len(weights)} target weights for {len(train_counts)} cells")
    if any(w < 0 for w in weights):
        raise TargetingError("target weights must be non-negative")
    total_weight = sum(weights)
    if total_weight == 0:
        raise TargetingError("the target distribution is empty: no cell has a positive weight")
    shares = [w / total_weight for w in weights]
    counts = [int(c) for c in train_counts["count"]]
    exact = _water_fill(counts, shares, budget)
    table = _base_table(train_counts)
    table["requested"] = _round_largest_remainder(exact, budget)
    return table


def plan_explicit(train_counts: pd.DataFrame, explicit: pd.DataFrame, source: str = "table") -> pd.DataFrame:
    """Explicit requested counts per cell; cells not listed get 0.

    Args:
        train_counts: the grid with the training positives in ``count``.
        explicit: rows ``sex, age_band, phase, requested`` (``count`` is accepted for ``requested``).
        source: where the table came from, for error messages.
    """
    explicit = explicit.rename(columns={"count": "requested"})
    missing = [c for c in TARGET_COLUMNS if c not in explicit.columns and c != "real_positives"]
    if missing:
        raise TargetingError(f"{source}: missing column(s) {missing} (expected sex, age_band, phase, requested)")
    requested: dict[tuple[str, str, str], int] = {}
    for row_number, row in enumerate(explicit.to_dict("records"), start=2):
        cell = read_cell(row, f"{source} row {row_number}")
        try:
            value = int(str(row["requested"]).strip())
        except ValueError:
            raise TargetingError(f"{source} row {row_number}: requested {row['requested']!r} is not an integer") from None
        if value < 0:
            raise TargetingError(f"{source} row {row_number}: requested {value} is negative")
        if cell in requested:
            raise TargetingError(f"{source} row {row_number}: cell {cell} is listed twice")
        requested[cell] = value
    table = _base_table(train_counts)
    cells = list(zip(table["sex"], table["age_band"], table["phase"]))
    outside = [cell for cell in requested if cell not in set(cells)]
    if outside:
        raise TargetingError(f"{source}: cell {outside[0]} is outside the targeted grid")
    table["requested"] = [requested.get(cell, 0) for cell in cells]
    return table


def resolve_targets(
    cohort_root: Path | str | Cohort,
    split_path: Path | str,
    rule: str,
    budget: int | None = None,
    sexes: Sequence[str] = SEXES,
    age_bands: Sequence[str] = AGE_BAND_NAMES,
    phases: Sequence[str] = PHASES,
    lesion_class: str = "pancreatic_lesion",
    baseline_records: pd.DataFrame | None = None,
    threshold: float | None = None,
    score: DetectionScore | str | None = None,
    detection: DetectionConfig | None = None,
) -> pd.DataFrame:
    """The targeting table for a cohort, its split and a rule (see the module docstring).

    Args:
        cohort_root: the real cohort (a folder or an already loaded :class:`Cohort`).
        split_path: its split CSV.
        rule: ``need:B``, ``min_positives:k``, ``match:val|uniform|<table>``, ``counts:<table>`` or a table path.
        budget: the total synthetic budget for ``match`` rules (required there; ``need`` carries its own).
        sexes / age_bands / phases: restrict the grid (e.g. to the phases the generator knows).
        lesion_class: the lesion mask that defines a positive case when ``tumor`` is not recorded.
        baseline_records: the baseline's per-case VALIDATION records (``need`` only).
        threshold: the baseline's operating point for records without a ``prediction`` column
            (default: ``detection``'s).
        score: ``volume`` or ``max_prob``, the score the threshold applies to (default: ``detection``'s).
        detection: the baseline's segmentation recipe's ``detection`` section, whose
            ``threshold_mm3`` and ``score`` apply when ``threshold`` and ``score`` are not given.
    """
    cohort = cohort_root if isinstance(cohort_root, Cohort) else load_cohort(cohort_root)
    split = load_split(split_path, cohort)
    cases = labelled_cases(cohort, split, lesion_class)
    grid = cell_grid(sexes, age_bands, phases)
    train_counts = count_positives(cases, "train", grid)
    kind, argument = parse_rule(rule)
    if kind == "min_positives":
        return plan_min_positives(train_counts, int(argument))
    if kind == "counts":
        return plan_explicit(train_counts, _read_table(Path(argument)), str(argument))
    if kind == "need":
        if baseline_records is None:
            raise TargetingError(f"rule {rule!r} needs the baseline's validation records (baseline_records)")
        missed = validation_misses(baseline_records, split, threshold, score, detection)
        return plan_need(train_counts, count_canvases(cases, grid), cell_deficits(missed, grid), int(argument))
    if budget is None:
        raise TargetingError(f"rule {rule!r} needs a total synthetic budget (--budget N)")
    if argument in SPLIT_NAMES:
        weights = count_positives(cases, argument, grid)["count"].tolist()
        if sum(weights) == 0:
            raise TargetingError(
                f"rule {rule!r}: the {argument} split has no positive case with known sex, age and phase"
            )
    elif argument == "uniform":
        weights = [1] * len(grid)
    else:
        weights = _weights_from_table(grid, _read_table(Path(argument)), str(argument))
    return plan_match_fillable(train_counts, count_canvases(cases, grid), weights, int(budget))


def plan_match_fillable(train_counts: pd.DataFrame, canvases: pd.DataFrame, target_weights: Sequence, budget: int) -> pd.DataFrame:
    """:func:`plan_match` over the cells that have a canvas; target cells without one are marked ``unfillable``.

    A cell without a healthy training scan cannot receive a synthetic case, so its share of the
    target is left out and the budget is spent on the others.
    """
    open_cells = [int(n) > 0 for n in canvases["count"]]
    weights = [Fraction(str(w)) if isinstance(w, float) else Fraction(w) for w in target_weights]
    kept = [w if fillable else Fraction(0) for w, fillable in zip(weights, open_cells)]
    if budget > 0 and sum(weights) > 0 and sum(kept) == 0:
        raise TargetingError("no cell of the target distribution has a healthy training scan (canvas) to paint into")
    table = plan_match(train_counts, kept, budget) if sum(kept) > 0 else plan_match(train_counts, weights, 0)
    table["canvases"] = canvases["count"].astype(int).to_numpy()
    table["unfillable"] = [w > 0 and not fillable for w, fillable in zip(weights, open_cells)]
    return table


def parse_rule(rule: str) -> tuple[str, str]:
    """Split a rule into (kind, argument): ``min_positives:4`` -> (``min_positives``, ``4``).

    Raises:
        TargetingError: an unknown rule, a bad number, or ``match:test`` (test labels must not shape training).
    """
    text = str(rule).strip()
    if text.startswith("match_") and ":" not in text:
        text = "match:" + text[len("match_"):]
    if ":" not in text:
        if Path(text).suffix.lower() in {".csv", ".yaml", ".yml"}:
            return "counts", text
        raise TargetingError(
            f"unknown targeting rule {rule!r} (expected need:B, min_positives:k, match:val, "
            "match:uniform, match:<table>, counts:<table>)"
        )
    kind, argument = (part.strip() for part in text.split(":", 1))
    if kind in {"min_positives", "need"}:
        if not argument.isdigit():
            raise TargetingError(f"rule {rule!r}: {'k' if kind == 'min_positives' else 'the budget'} must be a non-negative integer")
        return kind, argument
    if kind == "match" and argument == "test":
        raise TargetingError(
            f"rule {rule!r} is refused: it sizes the synthetic training data from the TEST split's labels, so the test "
            "set would shape training; use need:B (the baseline's validation deficit) or match:val"
        )
    if kind in {"match", "counts"} and argument:
        return kind, argument
    raise TargetingError(f"unknown targeting rule {rule!r}")


def validation_misses(records: pd.DataFrame, split: pd.DataFrame, threshold: float | None = None,
                      score: DetectionScore | str | None = None, detection: DetectionConfig | None = None) -> pd.DataFrame:
    """The baseline's validation positives with ``missed`` (1 = not detected) and their sex, age band, phase.

    Args:
        records: per-case validation records (the evaluation callback's ``val`` records).
        split: the split table; every record must be a ``val`` case of it.
        threshold: operating point for records without a ``prediction`` column (default: the recipe's).
        score: ``volume`` or ``max_prob`` (default: the recipe's).
        detection: the segmentation recipe's ``detection`` section (default: the schema's, BenchX's fixed m).

    Raises:
        TargetingError: a record outside the validation split (naming the case), missing columns.
    """
    from lightning_modules.evaluation.detection import decisions

    missing = [c for c in ("case_id", "label", *CELL_COLUMNS) if c not in records.columns]
    if missing:
        raise TargetingError(f"baseline records lack column(s) {missing}; expected the evaluation callback's val records")
    split_of = dict(zip(split["case_id"].astype(str), split["split"].astype(str)))
    for case_id in records["case_id"].astype(str):
        if split_of.get(case_id) != "val":
            where = split_of.get(case_id) or "no split"
            raise TargetingError(f"baseline record {case_id} is a {where} case: the need rule reads validation records only")
    if "prediction" in records.columns:
        detected = pd.to_numeric(records["prediction"], errors="coerce").fillna(0).to_numpy() == 1
    else:
        source = DetectionConfig() if detection is None else detection
        threshold = source.threshold_mm3 if threshold is None else threshold
        detected = decisions(records, threshold, DetectionScore(source.score if score is None else score))
    table = records[list(CELL_COLUMNS)].astype(str).copy()
    table["label"] = pd.to_numeric(records["label"], errors="coerce").to_numpy()
    table["missed"] = (~detected).astype(int)
    return table[table["label"] == 1].reset_index(drop=True)


def cell_deficits(missed: pd.DataFrame, grid: pd.DataFrame) -> list[tuple[Fraction, ...]]:
    """Each cell's deficit per attribute (sex, age band, phase): how much worse than average the
    baseline is in the cell's value of that attribute.

    A value's deficit is its validation miss rate minus the attribute's pooled miss rate (over the
    positives whose value is known), or 0 when it is not worse; a value without validation
    positives has no measured deficit (0). So the budget goes to the subgroups that fall behind
    (the gaps), not to every cell in proportion to an overall miss rate that all cells share. When
    no value of any attribute is worse than its pooled rate (every subgroup misses alike), each
    part is the value's miss rate divided by 3 instead, which spreads the budget.
    """
    if missed.empty:
        raise TargetingError("the baseline's validation records hold no positive case: there is no deficit to target")
    rates: dict[str, dict[str, Fraction]] = {}
    pooled: dict[str, Fraction] = {}
    for column in CELL_COLUMNS:
        known = missed[missed[column] != UNKNOWN]
        pooled[column] = Fraction(int(known["missed"].sum()), max(len(known), 1))
        rates[column] = {
            value: Fraction(int(part["missed"].sum()), len(part)) for value, part in known.groupby(column)
        }
    cells = grid.to_dict("records")
    deficits = [
        tuple(max(Fraction(0), rates[c].get(row[c], pooled[c]) - pooled[c]) for c in CELL_COLUMNS) for row in cells
    ]
    if any(any(parts) for parts in deficits):
        return deficits
    return [tuple(rates[c].get(row[c], pooled[c]) / len(CELL_COLUMNS) for c in CELL_COLUMNS) for row in cells]


def plan_need(
    train_counts: pd.DataFrame, canvases: pd.DataFrame, deficits: Sequence[Sequence[Fraction]], budget: int
) -> pd.DataFrame:
    """Spend ``budget`` across the cells that have a canvas, in proportion to their subgroups' deficits.

    Each subgroup (one value of sex, age band or phase) gets a share of the budget in proportion
    to its deficit, split evenly over its cells that have a canvas. So a phase that falls behind
    gets the same share whether it has two fillable cells or eight (with an allocation per cell,
    a gap with few fillable cells, e.g. a rare phase, got little). A cell's ``need`` in the table
    is the sum of its three deficits.

    Args:
        train_counts: the grid with the training positives in ``count``.
        canvases: the same grid with the canvases per cell in ``count`` (:func:`count_canvases`).
        deficits: one (sex, age band, phase) deficit triple per cell (:func:`cell_deficits`).
        budget: the total number of synthetic cases to request.
    """
    if budget < 0:
        raise TargetingError(f"the synthetic budget must be >= 0, got {budget}")
    open_cells = [int(n) > 0 for n in canvases["count"]]
    cells = train_counts[list(CELL_COLUMNS)].astype(str).to_dict("records")
    open_per_value = Counter(item for cell, fillable in zip(cells, open_cells) if fillable for item in cell.items())
    weights = [
        sum((part / open_per_value[column, cell[column]] for column, part in zip(CELL_COLUMNS, parts)), Fraction(0))
        if fillable else Fraction(0)
        for cell, parts, fillable in zip(cells, deficits, open_cells)
    ]
    total = sum(weights, Fraction(0))
    if budget > 0 and total == 0:
        raise TargetingError(
            "need: no cell with a canvas has a validation deficit (the baseline detects every validation tumor "
            "there, or no cell has a healthy training scan); use min_positives:k or match:val"
        )
    needs = [sum(parts, Fraction(0)) for parts in deficits]
    table = _base_table(train_counts)
    exact = [budget * w / total for w in weights] if total else [Fraction(0)] * len(weights)
    table["requested"] = _round_largest_remainder(exact, budget) if total else 0
    table["need"] = [float(n) for n in needs]
    table["canvases"] = canvases["count"].astype(int).to_numpy()
    # In need but without a healthy training scan of the cell: reported, never filled from another cell.
    table["unfillable"] = [bool(n > 0) and not fillable for n, fillable in zip(needs, open_cells)]
    return table


def requests_from_targets(targets: pd.DataFrame) -> list[dict]:
    """Expand a targeting table into one request per synthetic case.

    Each request is ``{"sex", "age_band", "phase", "index"}`` where ``index`` counts the cases of
    its cell from 0, so a request is identified by (cell, index) whatever the other cells hold:
    raising one cell's count later adds cases without renaming any.
    """
    missing = [c for c in CELL_COLUMNS + ("requested",) if c not in targets.columns]
    if missing:
        raise TargetingError(f"targeting table lacks column(s) {missing}")
    requests = []
    for row in targets.to_dict("records"):
        cell = read_cell(row, "targeting table")
        for index in range(int(row["requested"])):
            requests.append({"sex": cell[0], "age_band": cell[1], "phase": cell[2], "index": index})
    return requests


# ----------------------------------------------------------------------------------------------


def _base_table(train_counts: pd.DataFrame) -> pd.DataFrame:
    table = train_counts[list(CELL_COLUMNS)].copy()
    table["real_positives"] = train_counts["count"].astype(int).to_numpy()
    return table.reset_index(drop=True)


def _water_fill(counts: Sequence[int], shares: Sequence[Fraction], budget: int) -> list[Fraction]:
    """Solve ``sum_i max(0, p_i T - c_i) = B`` for the level ``T`` and return each ``max(0, p_i T - c_i)``.

    The left side is piecewise linear and increasing in ``T`` with a kink at each ``c_i / p_i``;
    walking the kinks in order finds the segment that holds the solution.
    """
    if budget == 0:
        return [Fraction(0)] * len(counts)
    kinks = sorted((Fraction(c) / p, i) for i, (c, p) in enumerate(zip(counts, shares)) if p > 0)
    active_share, active_count = Fraction(0), Fraction(0)
    level = Fraction(0)
    for position, (kink, i) in enumerate(kinks):
        active_share += shares[i]
        active_count += counts[i]
        level = (budget + active_count) / active_share
        next_kink = kinks[position + 1][0] if position + 1 < len(kinks) else None
        if next_kink is None or level <= next_kink:
            break
    return [max(Fraction(0), p * level - c) for c, p in zip(counts, shares)]


def _round_largest_remainder(values: Sequence[Fraction], total: int) -> list[int]:
    """Integers that sum to ``total``: floors first, then one more for the largest remainders (earlier cell on ties)."""
    floors = [int(v) for v in values]  # values are non-negative, so int() is floor
    missing = total - sum(floors)
    order = sorted(range(len(values)), key=lambda i: (-(values[i] - floors[i]), i))
    for i in order[:missing]:
        floors[i] += 1
    return floors


def _read_table(path: Path) -> pd.DataFrame:
    if not path.is_file():
        raise TargetingError(f"targeting table {path} does not exist")
    if path.suffix.lower() == ".csv":
        return pd.read_csv(path, dtype=str, keep_default_na=False)
    if path.suffix.lower() in {".yaml", ".yml"}:
        import yaml

        data = yaml.safe_load(path.read_text())
        if isinstance(data, Mapping) and "cells" in data:
            data = data["cells"]
        if not isinstance(data, list) or not all(isinstance(item, Mapping) for item in data):
            raise TargetingError(f"{path}: expected a list of {{sex, age_band, phase, requested}} mappings (or under 'cells')")
        return pd.DataFrame([{k: str(v) for k, v in item.items()} for item in data])
    raise TargetingError(f"targeting table {path}: expected a .csv, .yaml or .yml file")


def _weights_from_table(grid: pd.DataFrame, table: pd.DataFrame, source: str) -> list[Fraction]:
    """Per-cell weights from a ``sex, age_band, phase, weight`` table, in the grid's order (absent cells 0)."""
    if "weight" not in table.columns:
        raise TargetingError(f"{source}: a match distribution needs columns sex, age_band, phase, weight")
    weights: dict[tuple[str, str, str], Fraction] = {}
    for row_number, row in enumerate(table.to_dict("records"), start=2):
        cell = read_cell(row, f"{source} row {row_number}")
        try:
            weight = Fraction(str(row["weight"]).strip())
        except (ValueError, ZeroDivisionError):
            raise TargetingError(f"{source} row {row_number}: weight {row['weight']!r} is not a number") from None
        if cell in weights:
            raise TargetingError(f"{source} row {row_number}: cell {cell} is listed twice")
        weights[cell] = weight
    return [weights.get(cell, Fraction(0)) for cell in zip(grid["sex"], grid["age_band"], grid["phase"])]
