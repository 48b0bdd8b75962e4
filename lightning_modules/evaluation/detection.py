"""Scan-level tumor detection metrics overall and per subgroup (DESIGN.md sections 3, 4 and 6).

Input is a table of per-case records, one row per scan: ``case_id``, ``patient_id``, ``label``
(0/1, true scan-level tumor), ``volume_mm3`` (predicted tumor volume), ``max_prob`` and the
attribute columns ``age_band, sex, race, phase, cohort, tumor_size, tumor_location``. A scan is
predicted positive when its score exceeds the threshold m (DESIGN.md section 3). ``Unknown`` or an
empty value leaves a case out of that attribute's subgroups and keeps it in ``overall`` (BenchX 4.1).

Every metric is computed from weighted confusion counts and a weighted Mann-Whitney statistic by
:class:`WeightedSubgroupEvaluator`, so the point estimate (all weights 1) and every bootstrap
resample (:mod:`lightning_modules.evaluation.bootstrap`) go through one code path. A metric that is undefined
in a subgroup (no positives, no negatives) is NaN with its counts, never 0.

Example::

    threshold = choose_threshold(val_records, rule="f1")
    table = subgroup_metrics(test_records, threshold)
    print(gaps(table, "f1"))
    mlflow.log_metrics(mlflow_metric_keys(table, "test"))
"""

from __future__ import annotations

import math
import re
from typing import Sequence

import numpy as np
import pandas as pd
import scipy.sparse

from lightning_modules.data.lesions import PANCREAS_LOCATIONS, SMALL_TUMOR_MM, TUMOR_SIZE_GROUPS, tumor_size_group
from lightning_modules.data.metadata import AGE_BAND_NAMES, PHASES, SEXES, UNKNOWN

ATTRIBUTES = ("age", "sex", "race", "phase", "tumor_size", "tumor_location", "cohort")
ATTRIBUTE_COLUMNS = {
    "age": "age_band",
    "sex": "sex",
    "race": "race",
    "phase": "phase",
    "tumor_size": "tumor_size",
    "tumor_location": "tumor_location",
    "cohort": "cohort",
}
TUMOR_SIZES = TUMOR_SIZE_GROUPS
TUMOR_LOCATIONS = PANCREAS_LOCATIONS
# Attributes with a closed vocabulary: every group gets a row (an empty one reports n=0), and any
# other value is an error rather than a silently new group.
CLOSED_GROUPS: dict[str, tuple[str, ...]] = {
    "age": AGE_BAND_NAMES,
    "sex": SEXES,
    "phase": PHASES,
    "tumor_size": TUMOR_SIZES,
}
# Open attributes list the recorded categories; these come first, in anatomical order.
PREFERRED_ORDER: dict[str, tuple[str, ...]] = {"tumor_location": TUMOR_LOCATIONS}
EXCLUDED_VALUES = frozenset({UNKNOWN, ""})

SCORE_COLUMNS = {"volume": "volume_mm3", "max_prob": "max_prob"}
COUNT_COLUMNS = ("n", "positives", "negatives", "tp", "fp", "tn", "fn")
RATE_METRICS = ("sensitivity", "specificity", "f1", "auc", "auc_binary")
GAP_METRICS = ("f1", "sensitivity", "specificity", "auc_binary")
OVERALL = ("overall", "all")

_MLFLOW_UNSAFE = re.compile(r"[^A-Za-z0-9_\-. :]")


# ------------------------------------------------------------------------------------------------
# Records: validation, scores, decisions


def _source(records: pd.DataFrame) -> str:
    """The name errors use for the records: ``records.attrs['source']`` (e.g. a CSV path) if set."""
    return str(records.attrs.get("source", "records"))


def score_column(score: str) -> str:
    """The record column holding a score kind (``volume`` -> ``volume_mm3``, ``max_prob``)."""
    if score not in SCORE_COLUMNS:
        raise ValueError(f"unknown score {score!r}: expected one of {sorted(SCORE_COLUMNS)}")
    return SCORE_COLUMNS[score]


def attribute_values(records: pd.DataFrame, attribute: str) -> np.ndarray:
    """An attribute's values as stripped strings; NaN/None and any spelling of unknown read as ``Unknown``."""
    if attribute not in ATTRIBUTE_COLUMNS:
        raise ValueError(f"unknown attribute {attribute!r}: expected one of {ATTRIBUTES}")
    column = records[ATTRIBUTE_COLUMNS[attribute]]
    text = column.astype(str).str.strip()
    values = text.to_numpy(dtype=object)
    values[column.isna().to_numpy() | (text.str.lower() == UNKNOWN.lower()).to_numpy()] = UNKNOWN
    return values


def validate_records(
    records: pd.DataFrame, score: str = "volume", attributes: Sequence[str] = ATTRIBUTES
) -> None:
    """Raise ValueError naming the source, case and column of the first problems found in ``records``.

    Checks: required columns present, case ids unique and non-empty, patient ids non-empty, labels
    0/1, scores finite, closed attributes (age band, sex, phase, tumor size) within their
    vocabulary, and tumor size given only for positive scans.

    Args:
        records: per-case records (see the module docstring).
        score: ``volume`` or ``max_prob``; its column must be present and finite.
        attributes: the attributes whose columns must be present.
    """
    source = _source(records)
    unknown_attributes = [a for a in attributes if a not in ATTRIBUTE_COLUMNS]
    if unknown_attributes:
        raise ValueError(f"unknown attributes {unknown_attributes}: expected a subset of {ATTRIBUTES}")
    required = ["case_id", "patient_id", "label", score_column(score)]
    required += [ATTRIBUTE_COLUMNS[a] for a in attributes]
    missing = [c for c in required if c not in records.columns]
    if missing:
        raise ValueError(f"{source}: missing column(s) {missing}; records need {required}")
    if len(records) == 0:
        raise ValueError(f"{source}: no records")

    case_ids = records["case_id"].astype(str).str.strip()
    problems: list[str] = []
    empty = records["case_id"].isna() | (case_ids == "")
    if empty.any():
        problems.append(f"row {int(np.flatnonzero(empty.to_numpy())[0])}: empty case_id")
    for case_id in case_ids[case_ids.duplicated()].unique()[:5]:
        problems.append(f"case {case_id}: duplicate case_id")
    patients = records["patient_id"]
    empty_patient = patients.isna().to_numpy() | (patients.astype(str).str.strip() == "").to_numpy()
    for i in np.flatnonzero(empty_patient)[:5]:
        problems.append(f"case {case_ids.iloc[i]}: column 'patient_id' is empty")

    label_values = pd.to_numeric(records["label"], errors="coerce").to_numpy(dtype=float)
    bad_labels = ~np.isin(label_values, (0.0, 1.0))
    for i in np.flatnonzero(bad_labels)[:5]:
        problems.append(f"case {case_ids.iloc[i]}: column 'label' must be 0 or 1, got {records['label'].iloc[i]!r}")
    column = score_column(score)
    values = pd.to_numeric(records[column], errors="coerce").to_numpy(dtype=float)
    for i in np.flatnonzero(~np.isfinite(values))[:5]:
        problems.append(
            f"case {case_ids.iloc[i]}: column '{column}' must be a finite number, got {records[column].iloc[i]!r}"
        )

    for attribute in attributes:
        if attribute not in CLOSED_GROUPS:
            continue
        values_a = attribute_values(records, attribute)
        allowed = set(CLOSED_GROUPS[attribute]) | EXCLUDED_VALUES
        for i in np.flatnonzero(~np.isin(values_a, list(allowed)))[:5]:
            problems.append(
                f"case {case_ids.iloc[i]}: column '{ATTRIBUTE_COLUMNS[attribute]}' has {values_a[i]!r}; "
                f"expected one of {list(CLOSED_GROUPS[attribute])} or Unknown/empty"
            )
    if "tumor_size" in attributes:
        sizes = attribute_values(records, "tumor_size")
        sized_negative = np.isin(sizes, TUMOR_SIZES) & (label_values == 0)
        for i in np.flatnonzero(sized_negative)[:5]:
            problems.append(
                f"case {case_ids.iloc[i]}: column 'tumor_size' is {sizes[i]!r} on a scan with label 0 "
                "(tumor size is for positive scans only; use '' for negatives)"
            )
    if problems:
        raise ValueError(f"{source}: invalid records:\n  " + "\n  ".join(problems))


def scores(records: pd.DataFrame, score: str = "volume") -> np.ndarray:
    """The continuous detection score of each case: predicted tumor volume (mm³) or max probability.

    Args:
        records: per-case records.
        score: ``volume`` (column ``volume_mm3``) or ``max_prob``.
    """
    column = score_column(score)
    if column not in records.columns:
        raise ValueError(f"{_source(records)}: missing column '{column}' for score {score!r}")
    values = pd.to_numeric(records[column], errors="coerce").to_numpy(dtype=float)
    bad = np.flatnonzero(~np.isfinite(values))
    if len(bad):
        case = records["case_id"].iloc[bad[0]] if "case_id" in records else f"row {bad[0]}"
        raise ValueError(f"{_source(records)}: case {case}: column '{column}' must be a finite number")
    return values


def decisions(records: pd.DataFrame, threshold_mm3: float, score: str = "volume") -> np.ndarray:
    """Scan-level decisions: positive when the score exceeds the threshold (DESIGN.md section 3).

    Args:
        records: per-case records.
        threshold_mm3: m in mm³ for ``volume``; a probability for ``max_prob``.
        score: ``volume`` or ``max_prob``.
    """
    return scores(records, score) > float(threshold_mm3)


def labels(records: pd.DataFrame) -> np.ndarray:
    """The true scan-level labels as a boolean array (ValueError on anything but 0/1)."""
    values = pd.to_numeric(records["label"], errors="coerce").to_numpy(dtype=float)
    bad = np.flatnonzero(~np.isin(values, (0.0, 1.0)))
    if len(bad):
        raise ValueError(
            f"{_source(records)}: case {records['case_id'].iloc[bad[0]]}: column 'label' must be 0 or 1, "
            f"got {records['label'].iloc[bad[0]]!r}"
        )
    return values == 1.0


def tumor_size_groups(diameters_mm, labels_, small_tumor_mm: float = SMALL_TUMOR_MM) -> np.ndarray:
    """The ``tumor_size`` attribute per case, by :func:`lightning_modules.data.lesions.tumor_size_group`:
    ``small`` (largest extent <= small_tumor_mm), ``large``, ``Unknown`` for a positive without a
    diameter, and ``''`` for negatives (``docs/design.md "Lesion size and location"``).

    Args:
        diameters_mm: largest tumor extent per case (NaN when unknown).
        labels_: true scan-level labels (0/1).
        small_tumor_mm: the recipe's ``detection.small_tumor_mm`` (BenchX: 20 mm).
    """
    diameters = np.asarray(diameters_mm, dtype=float)
    positive = np.asarray(labels_).astype(int)
    return np.array([tumor_size_group(d, t, small_tumor_mm) for d, t in zip(diameters, positive)], dtype=object)


# ------------------------------------------------------------------------------------------------
# Threshold choice


def choose_threshold(records: pd.DataFrame, rule: str = "f1", score: str = "volume") -> float:
    """Choose the detection threshold on validation records; it is then applied unchanged to test.

    Candidates are the midpoints between consecutive sorted unique scores, so every candidate
    separates the scans differently and none sits on a score. ``rule="f1"`` maximizes
    F1 = 2TP/(2TP+FP+FN); ``rule="youden"`` maximizes Youden's J = sensitivity + specificity - 1
    (compared in exact integer arithmetic). Ties go to the smaller threshold.

    Args:
        records: validation records.
        rule: ``f1`` or ``youden``.
        score: ``volume`` or ``max_prob``.

    Raises:
        ValueError: unknown rule, fewer than two distinct scores, no positives (F1, Youden) or no
            negatives (Youden).
    """
    if rule not in ("f1", "youden"):
        raise ValueError(f"unknown threshold rule {rule!r}: expected 'f1' or 'youden'")
    values = scores(records, score)
    truth = labels(records)
    source = _source(records)
    positives, negatives = int(truth.sum()), int((~truth).sum())
    if positives == 0:
        raise ValueError(f"{source}: cannot choose a threshold by {rule}: no positive scans")
    if rule == "youden" and negatives == 0:
        raise ValueError(f"{source}: cannot choose a threshold by youden: no negative scans")
    unique, inverse = np.unique(values, return_inverse=True)
    if len(unique) < 2:
        raise ValueError(
            f"{source}: cannot choose a threshold: all {len(values)} scores equal {unique[0]!r}, "
            "so no threshold separates any scans"
        )
    # Cases at or above unique[i + 1] are called positive by the candidate between unique[i] and unique[i + 1].
    positives_at = np.bincount(inverse, weights=truth.astype(float), minlength=len(unique)).astype(np.int64)
    negatives_at = np.bincount(inverse, weights=(~truth).astype(float), minlength=len(unique)).astype(np.int64)
    tp = np.cumsum(positives_at[::-1])[::-1][1:]
    fp = np.cumsum(negatives_at[::-1])[::-1][1:]
    fn = positives - tp
    tn = negatives - fp
    candidates = (unique[:-1] + unique[1:]) / 2.0
    if rule == "f1":
        objective = 2.0 * tp / (2.0 * tp + fp + fn)
    else:
        # J = (tp*N + tn*P)/(P*N) - 1: compare the integer numerators so ties are exact.
        objective = tp * negatives + tn * positives
    # argmax returns the first maximum; candidates ascend, so ties go to the smaller threshold.
    return float(candidates[int(np.argmax(objective))])


# ------------------------------------------------------------------------------------------------
# Subgroups


def _group_order(attribute: str, values: np.ndarray) -> list[str]:
    present = sorted({v for v in values if v not in EXCLUDED_VALUES})
    if attribute in CLOSED_GROUPS:
        return list(CLOSED_GROUPS[attribute])
    preferred = [g for g in PREFERRED_ORDER.get(attribute, ()) if g in present]
    return preferred + [g for g in present if g not in preferred]


def subgroup_membership(
    records: pd.DataFrame, attributes: Sequence[str] = ATTRIBUTES
) -> tuple[pd.DataFrame, np.ndarray]:
    """The subgroup rows and which cases belong to each.

    Returns a table with columns ``attribute, group`` (``overall, all`` first, then each attribute's
    groups in order: closed vocabularies in full, open ones as recorded, sorted) and a boolean
    membership matrix (n_cases x n_rows). ``Unknown``/empty values belong to no group of their
    attribute but are in ``overall``.

    Args:
        records: per-case records.
        attributes: attributes to split by, a subset of :data:`ATTRIBUTES`.
    """
    rows: list[tuple[str, str]] = [OVERALL]
    columns: list[np.ndarray] = [np.ones(len(records), dtype=bool)]
    for attribute in attributes:
        values = attribute_values(records, attribute)
        for group in _group_order(attribute, values):
            rows.append((attribute, group))
            columns.append(values == group)
    table = pd.DataFrame(rows, columns=["attribute", "group"])
    return table, np.stack(columns, axis=1)


class WeightedSubgroupEvaluator:
    """Confusion counts, sensitivity, specificity, F1 and ROC AUC of every subgroup under patient weights.

    A weight vector gives each patient a multiplicity (all ones for the point estimate, bootstrap
    draw counts for a resample); a case counts with its patient's weight, so a patient's scans
    always move together. All subgroups and all weight vectors are handled by one sparse product
    ``S @ W`` where ``S`` (columns x patients) sums, per subgroup, each patient's cases into

    - four count columns (TP, FP, TN, FN at the threshold), and
    - for the AUC: one column per distinct positive score v_1 < ... < v_m of the subgroup (positive
      weight at v_j), and two per v_j for the negatives (weight strictly between v_{j-1} and v_j,
      and weight equal to v_j; negatives above v_m never count).

    The weighted Mann-Whitney statistic is then sum_j P_j (below_j + eq_j / 2) / (P_total N_total),
    where below_j is a cumulative sum over the negative columns: one sort of the scores (inside
    ``np.unique``) and cumulative sums, ties counting one half, exactly as ``roc_auc_score``.

    Args:
        records: per-case records (validated here).
        threshold: detection threshold m.
        score: ``volume`` or ``max_prob``.
        attributes: attributes to split by.
    """

    def __init__(
        self,
        records: pd.DataFrame,
        threshold: float,
        score: str = "volume",
        attributes: Sequence[str] = ATTRIBUTES,
    ):
        validate_records(records, score=score, attributes=attributes)
        self.threshold = float(threshold)
        self.score = score
        self.case_ids = records["case_id"].astype(str).str.strip().to_numpy()
        self.patients, self.case_patient = np.unique(
            records["patient_id"].astype(str).str.strip().to_numpy(), return_inverse=True
        )
        self.rows, membership = subgroup_membership(records, attributes)
        values = scores(records, score)
        truth = labels(records)
        predicted = values > self.threshold
        # 0: TP, 1: FP, 2: TN, 3: FN
        outcome = np.where(truth, np.where(predicted, 0, 3), np.where(predicted, 1, 2))

        n_rows = len(self.rows)
        count_entries: list[tuple[np.ndarray, np.ndarray]] = []
        positive_entries: list[tuple[np.ndarray, np.ndarray]] = []
        negative_entries: list[tuple[np.ndarray, np.ndarray]] = []
        positive_offsets = np.zeros(n_rows + 1, dtype=np.int64)
        for row in range(n_rows):
            members = np.flatnonzero(membership[:, row])
            count_entries.append((self.case_patient[members], 4 * row + outcome[members]))
            member_positive = members[truth[members]]
            member_negative = members[~truth[members]]
            distinct, inverse = np.unique(values[member_positive], return_inverse=True)
            offset = positive_offsets[row]
            positive_offsets[row + 1] = offset + len(distinct)
            positive_entries.append((self.case_patient[member_positive], offset + inverse))
            if len(distinct) == 0:
                continue
            negative_scores = values[member_negative]
            slot = np.searchsorted(distinct, negative_scores, side="left")
            counted = slot < len(distinct)
            slot, member_negative, negative_scores = slot[counted], member_negative[counted], negative_scores[counted]
            tied = distinct[slot] == negative_scores
            negative_entries.append((self.case_patient[member_negative], 2 * (offset + slot) + tied))

        n_positive_columns = int(positive_offsets[-1])
        self._n_rows = n_rows
        self._count_slice = slice(0, 4 * n_rows)
        self._positive_slice = slice(4 * n_rows, 4 * n_rows + n_positive_columns)
        self._negative_slice = slice(4 * n_rows + n_positive_columns, 4 * n_rows + 3 * n_positive_columns)
        patient_index, column_index = [], []
        for entries, start in (
            (count_entries, 0),
            (positive_entries, self._positive_slice.start),
            (negative_entries, self._negative_slice.start),
        ):
            for patients, columns in entries:
                patient_index.append(patients)
                column_index.append(columns + start)
        patient_index_all = np.concatenate(patient_index) if patient_index else np.zeros(0, dtype=np.int64)
        column_index_all = np.concatenate(column_index) if column_index else np.zeros(0, dtype=np.int64)
        n_columns = self._negative_slice.stop
        # COO -> CSR sums duplicate (column, patient) pairs: a patient's cases in one column add up.
        self._projection = scipy.sparse.coo_matrix(
            (np.ones(len(column_index_all)), (column_index_all, patient_index_all)),
            shape=(n_columns, len(self.patients)),
        ).tocsr()
        # For integer weights whose sums stay below 2**24, float32 gives the same exact counts at
        # half the memory traffic; the bootstrap checks that bound before using it.
        self._projection_float32 = self._projection.astype(np.float32)
        self.cases_per_patient = np.bincount(self.case_patient, minlength=len(self.patients))
        self._positive_offsets = positive_offsets
        self._rows_with_positives = np.flatnonzero(np.diff(positive_offsets) > 0)

    @property
    def n_patients(self) -> int:
        return len(self.patients)

    @property
    def n_columns(self) -> int:
        """Columns of the sparse projection (memory per resample is about 8 bytes x 3 x this)."""
        return self._projection.shape[0]

    def evaluate(self, patient_weights: np.ndarray) -> dict[str, np.ndarray]:
        """Every metric of every subgroup for each weight vector.

        Args:
            patient_weights: (n_weightings x n_patients) non-negative weights, patients in the
                order of :attr:`patients` (sorted patient ids); a 1-D vector is one weighting.

        Returns:
            metric name -> (n_weightings x n_rows) array for the count columns and the rate
            metrics; undefined rates are NaN.
        """
        weights = np.atleast_2d(np.asarray(patient_weights, dtype=float))
        if weights.shape[1] != self.n_patients:
            raise ValueError(f"patient_weights has {weights.shape[1]} columns, expected {self.n_patients} patients")
        return self.evaluate_columns(np.ascontiguousarray(weights.T))

    def evaluate_columns(self, weights_by_patient: np.ndarray) -> dict[str, np.ndarray]:
        """As :meth:`evaluate`, with the weights given as (n_patients x n_weightings), C-contiguous.

        This is the layout the sparse product wants; the bootstrap builds its blocks in it directly.
        float32 weights are only for integer weights whose total case weight (``cases_per_patient``
        @ weights) is below 2**24, where every float32 sum is exact; results are float64 either way.
        """
        if weights_by_patient.dtype == np.float32:
            projected = self._projection_float32 @ weights_by_patient
        else:
            projected = self._projection @ np.asarray(weights_by_patient, dtype=np.float64)
        # Weightings as rows from here on: the cumulative sums then run along contiguous memory.
        projected = np.ascontiguousarray(projected.T, dtype=np.float64)
        counts = projected[:, self._count_slice].reshape(-1, self._n_rows, 4)
        tp, fp, tn, fn = (counts[:, :, k] for k in range(4))
        positives, negatives = tp + fn, tn + fp
        with np.errstate(invalid="ignore", divide="ignore"):
            sensitivity = np.where(positives > 0, tp / positives, np.nan)
            specificity = np.where(negatives > 0, tn / negatives, np.nan)
            f1_denominator = 2 * tp + fp + fn
            f1 = np.where(f1_denominator > 0, 2 * tp / f1_denominator, np.nan)
        auc = self._auc(projected, positives, negatives)
        return {
            "n": positives + negatives,
            "positives": positives,
            "negatives": negatives,
            "tp": tp,
            "fp": fp,
            "tn": tn,
            "fn": fn,
            "sensitivity": sensitivity,
            "specificity": specificity,
            "f1": f1,
            "auc": auc,
            "auc_binary": (sensitivity + specificity) / 2.0,
        }

    def _auc(self, projected: np.ndarray, positives: np.ndarray, negatives: np.ndarray) -> np.ndarray:
        n_weightings = projected.shape[0]
        auc = np.full((n_weightings, self._n_rows), np.nan)
        rows = self._rows_with_positives
        if len(rows) == 0:
            return auc
        positive_weight = projected[:, self._positive_slice]
        negative_cumulative = np.cumsum(projected[:, self._negative_slice], axis=1)
        # One cumsum runs over all rows. For positive score v_j, column 2j holds the negative weight
        # below v_j and 2j+1 that below or equal, each plus what earlier rows accumulated
        # ("carried"), which is removed per row below. Integer weights keep these sums exact.
        numerator_terms = positive_weight * (negative_cumulative[:, 0::2] + negative_cumulative[:, 1::2]) / 2.0
        starts = self._positive_offsets[rows]
        numerator = np.add.reduceat(numerator_terms, starts, axis=1)  # (weightings x rows with positives)
        row_start = 2 * starts
        carried = np.zeros_like(numerator)
        later = row_start > 0
        carried[:, later] = negative_cumulative[:, row_start[later] - 1]
        numerator -= carried * positives[:, rows]
        denominator = positives[:, rows] * negatives[:, rows]
        with np.errstate(invalid="ignore", divide="ignore"):
            auc[:, rows] = np.where(denominator > 0, numerator / denominator, np.nan)
        return auc

    def table(self, statistics: dict[str, np.ndarray], index: int = 0) -> pd.DataFrame:
        """The subgroup table of one weighting (``index``) from :meth:`evaluate`'s output."""
        table = self.rows.copy()
        for name in COUNT_COLUMNS:
            table[name] = np.rint(statistics[name][index]).astype(np.int64)
        for name in RATE_METRICS:
            table[name] = statistics[name][index]
        return table


def subgroup_metrics(
    records: pd.DataFrame,
    threshold: float,
    score: str = "volume",
    attributes: Sequence[str] = ATTRIBUTES,
) -> pd.DataFrame:
    """Detection metrics overall and per subgroup, one row per (attribute, group).

    Columns: attribute, group, n, positives, negatives, tp, fp, tn, fn, sensitivity, specificity,
    f1, auc (ROC AUC of the continuous score), auc_binary ((sensitivity + specificity)/2, the
    BenchX tables' AUC). Undefined metrics are NaN: sensitivity and auc without positives,
    specificity and auc without negatives, F1 only when TP+FP+FN = 0. Counts are always there.

    Args:
        records: per-case records.
        threshold: detection threshold m (mm³ for ``volume``, a probability for ``max_prob``).
        score: ``volume`` or ``max_prob``.
        attributes: attributes to split by.
    """
    evaluator = WeightedSubgroupEvaluator(records, threshold, score=score, attributes=attributes)
    table = evaluator.table(evaluator.evaluate(np.ones(evaluator.n_patients)))
    table.attrs.update({"threshold": float(threshold), "score": score})
    return table


def gaps(table: pd.DataFrame, metric: str) -> pd.DataFrame:
    """Per attribute: the worst and best group on ``metric`` and the gap (best - worst).

    Only groups where the metric is defined count; an attribute with none has NaN values and
    empty group names. Ties go to the group listed first.

    Args:
        table: a subgroup table from :func:`subgroup_metrics` or the bootstrap.
        metric: a column of the table, e.g. ``f1``.
    """
    if metric not in table.columns:
        raise ValueError(f"metric {metric!r} is not a column of the subgroup table")
    rows = []
    subgroups = table[table["attribute"] != OVERALL[0]]
    for attribute in dict.fromkeys(subgroups["attribute"]):
        part = subgroups[subgroups["attribute"] == attribute]
        values = part[metric].astype(float).to_numpy()
        defined = np.flatnonzero(~np.isnan(values))
        if len(defined) == 0:
            rows.append((attribute, metric, "", math.nan, "", math.nan, math.nan, 0))
            continue
        worst = defined[int(np.argmin(values[defined]))]
        best = defined[int(np.argmax(values[defined]))]
        groups = part["group"].to_numpy()
        rows.append(
            (attribute, metric, groups[worst], values[worst], groups[best], values[best],
             values[best] - values[worst], len(defined))
        )
    return pd.DataFrame(
        rows, columns=["attribute", "metric", "worst_group", "worst", "best_group", "best", "gap", "groups_defined"]
    )


# ------------------------------------------------------------------------------------------------
# MLflow


def mlflow_safe(name: str) -> str:
    """A name reduced to MLflow's key characters; ``/`` is replaced too, as it separates key levels."""
    safe = _MLFLOW_UNSAFE.sub("_", str(name).replace("/", "_")).strip()
    if not safe:
        raise ValueError(f"name {name!r} has no characters MLflow allows in a metric key")
    return safe


def mlflow_metric_keys(table: pd.DataFrame, stage: str, ci: bool = True) -> dict[str, float]:
    """Flatten a subgroup table into MLflow metrics (DESIGN.md section 6).

    Keys are ``<stage>/<metric>/<attribute>/<group>`` (``<stage>/<metric>/overall`` for the
    overall row), ``<stage>/<metric>_ci_low/...`` and ``_ci_high`` when the table has CIs and
    ``ci`` is set, and per attribute ``<stage>/<metric>_gap/<attribute>`` and
    ``<stage>/<metric>_worst/<attribute>`` for f1, sensitivity, specificity and auc_binary.
    Undefined (NaN) values are left out; counts are always present.

    Args:
        table: a subgroup table.
        stage: ``val``, ``test``, ...
        ci: include CI bounds when the table has them.
    """
    if not stage or _MLFLOW_UNSAFE.search(stage) or "/" in stage:
        raise ValueError(f"stage {stage!r} must be a non-empty name of letters, digits, '_', '-', '.', ':' or spaces")
    metrics: dict[str, float] = {}
    origin: dict[str, tuple[str, str]] = {}
    rate_columns = [m for m in RATE_METRICS if m in table.columns]
    ci_columns = []
    if ci:
        candidates = [f"{m}_ci_{side}" for m in RATE_METRICS for side in ("low", "high")]
        ci_columns = [c for c in candidates if c in table.columns]
    for row in table.itertuples(index=False):
        row_values = row._asdict()
        attribute, group = str(row_values["attribute"]), str(row_values["group"])
        if (attribute, group) == OVERALL:
            suffix = "overall"
        else:
            suffix = f"{mlflow_safe(attribute)}/{mlflow_safe(group)}"
        probe = f"{stage}/n/{suffix}"
        if probe in metrics and origin[probe] != (attribute, group):
            raise ValueError(
                f"groups {origin[probe]} and {(attribute, group)} map to the same MLflow key {probe!r}; rename one"
            )
        for name in COUNT_COLUMNS:
            if name in row_values:
                key = f"{stage}/{name}/{suffix}"
                metrics[key] = float(row_values[name])
                origin[key] = (attribute, group)
        for name in rate_columns + ci_columns:
            value = float(row_values[name])
            if not math.isnan(value):
                metrics[f"{stage}/{name}/{suffix}"] = value
    for metric in GAP_METRICS:
        if metric not in table.columns:
            continue
        for gap in gaps(table, metric).itertuples(index=False):
            if not math.isnan(gap.gap):
                attribute = mlflow_safe(gap.attribute)
                metrics[f"{stage}/{metric}_gap/{attribute}"] = float(gap.gap)
                metrics[f"{stage}/{metric}_worst/{attribute}"] = float(gap.worst)
    return metrics
