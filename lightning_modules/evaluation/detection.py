"""Scan-level tumor detection: decisions, confusion counts, sensitivity, specificity, F1 and ROC AUC,
overall and per subgroup (docs/explanation/detection-and-statistics.md "Scan-level detection").

This is the one home of scan-level detection metrics. A scan is predicted positive when its score
(predicted tumor volume in mm³, or the maximum tumor probability) exceeds the threshold m. Every
metric is computed from weighted confusion counts and a weighted Mann-Whitney statistic by
:class:`WeightedSubgroupEvaluator`, so the point estimate (all weights 1) and every bootstrap
resample (``evaluation.bootstrap``) go through one code path. A metric that is undefined in a
subgroup (no positives, no negatives) is NaN with its counts, never 0. Pure functions: records in,
tables out; MLflow keys are in ``evaluation.metric_keys``, operating points in
``evaluation.thresholds``.

Example::

    threshold = choose_operating_point(val_records, rule="youden", fixed=50.0).threshold
    table = subgroup_metrics(test_records, threshold)
    print(gaps(table, "f1"))
"""

from __future__ import annotations

import copy

from typing import Sequence

import numpy as np
import pandas as pd
import scipy.sparse

from lightning_modules.evaluation.records import ATTRIBUTES, labels, scores, validate_records
from lightning_modules.evaluation.subgroups import subgroup_membership

COUNT_COLUMNS = ("n", "positives", "negatives", "tp", "fp", "tn", "fn")
RATE_METRICS = ("sensitivity", "specificity", "f1", "auc", "auc_binary")


def decisions(records: pd.DataFrame, threshold_mm3: float, score: str = "volume") -> np.ndarray:
    """Scan-level decisions: positive when the score exceeds the threshold (strictly).

    Args:
        records: per-case records.
        threshold_mm3: m in mm³ for ``volume``; a probability for ``max_prob``.
        score: ``volume`` or ``max_prob``.
    """
    return scores(records, score) > float(threshold_mm3)


def rates(tp, fp, tn, fn) -> dict[str, np.ndarray]:
    """Sensitivity, specificity, F1 and auc_binary from (weighted) confusion counts; NaN where undefined.

    F1 = 2TP/(2TP+FP+FN) is NaN only when TP+FP+FN = 0; ``subgroups.metric_defined`` decides where
    it says something about detection (a group with tumors).
    """
    positives, negatives = tp + fn, tn + fp
    with np.errstate(invalid="ignore", divide="ignore"):
        sensitivity = np.where(positives > 0, tp / positives, np.nan)
        specificity = np.where(negatives > 0, tn / negatives, np.nan)
        f1_denominator = 2 * tp + fp + fn
        f1 = np.where(f1_denominator > 0, 2 * tp / f1_denominator, np.nan)
    return {
        "sensitivity": sensitivity,
        "specificity": specificity,
        "f1": f1,
        "auc_binary": (sensitivity + specificity) / 2.0,
    }


def lesion_counts(records: pd.DataFrame) -> tuple[np.ndarray, np.ndarray] | None:
    """Per case, its true lesions and the lesions a predicted component overlaps (None when the
    records do not hold them): the lesion-level hits beside the scan-level metrics."""
    if not {"lesions", "lesions_found"} <= set(records.columns):
        return None
    lesions = pd.to_numeric(records["lesions"], errors="coerce").fillna(0).to_numpy(dtype=np.int64)
    found = pd.to_numeric(records["lesions_found"], errors="coerce").fillna(0).to_numpy(dtype=np.int64)
    return lesions, found


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
        self.rows, self._membership = subgroup_membership(records, attributes)
        self.cases_per_patient = np.bincount(self.case_patient, minlength=len(self.patients))
        self.row_patients = np.array(
            [len(np.unique(self.case_patient[self._membership[:, row]])) for row in range(len(self.rows))], dtype=np.int64
        )
        self._set_scores(scores(records, score), labels(records))
        self.lesion_counts = lesion_counts(records)

    @classmethod
    def on_same_cases(cls, reference: "WeightedSubgroupEvaluator", records: pd.DataFrame, threshold: float) -> "WeightedSubgroupEvaluator":
        """Another run's evaluator on the reference's evaluation set, reusing its patients and subgroups.

        For a paired comparison, where the caller has checked that ``records`` hold the same cases
        with the same patients, labels and attributes (``paired_comparison._check_same_evaluation_set``):
        only the scores are read (and validated), in the reference's case order, so comparing
        many runs with one reference does not rebuild the subgroups for each.

        Raises:
            ValueError: a case of the reference is missing, or a score is missing or not finite.
        """
        validate_records(records, score=reference.score, attributes=())
        ids = pd.Index(records["case_id"].astype(str).str.strip())
        order = ids.get_indexer(reference.case_ids)
        if (order < 0).any():
            raise ValueError(f"case {reference.case_ids[np.flatnonzero(order < 0)[0]]} of the reference is not in the records")
        aligned = records.iloc[order]
        evaluator = copy.copy(reference)  # shares the patients and subgroups; the projection is replaced below
        evaluator.threshold = float(threshold)
        evaluator._set_scores(scores(aligned, reference.score), labels(aligned))
        evaluator.lesion_counts = lesion_counts(aligned)
        return evaluator

    def at_threshold(self, threshold: float) -> "WeightedSubgroupEvaluator":
        """This evaluator's cases, scores and subgroups at another threshold m (the AUC is unchanged)."""
        evaluator = copy.copy(self)
        evaluator.threshold = float(threshold)
        evaluator._set_scores(self.values, self.truth)
        return evaluator

    def member_cases(self, row: int) -> np.ndarray:
        """Positions (in :attr:`case_ids` order) of the cases of subgroup row ``row``."""
        return np.flatnonzero(self._membership[:, row])

    def _set_scores(self, values: np.ndarray, truth: np.ndarray) -> None:
        """The sparse projection for these scores and labels (cases in :attr:`case_ids` order)."""
        self.values, self.truth = values, truth
        self._n_rows = len(self.rows)
        entries, positive_offsets = self._row_entries(self._membership, values, truth)
        self._positive_offsets = positive_offsets
        self._rows_with_positives = np.flatnonzero(np.diff(positive_offsets) > 0)
        self._projection = self._build_projection(entries, int(positive_offsets[-1]))
        # For integer weights whose sums stay below 2**24, float32 gives the same exact counts at
        # half the memory traffic; the bootstrap checks that bound before using it.
        self._projection_float32 = self._projection.astype(np.float32)

    def _row_entries(self, membership: np.ndarray, values: np.ndarray, truth: np.ndarray):
        """Per kind of column (counts, positive scores, negative slots): (patients, columns) pairs."""
        predicted = values > self.threshold
        # 0: TP, 1: FP, 2: TN, 3: FN
        outcome = np.where(truth, np.where(predicted, 0, 3), np.where(predicted, 1, 2))
        counts, positives, negatives = [], [], []
        positive_offsets = np.zeros(self._n_rows + 1, dtype=np.int64)
        for row in range(self._n_rows):
            members = np.flatnonzero(membership[:, row])
            counts.append((self.case_patient[members], 4 * row + outcome[members]))
            member_positive, member_negative = members[truth[members]], members[~truth[members]]
            distinct, inverse = np.unique(values[member_positive], return_inverse=True)
            offset = positive_offsets[row]
            positive_offsets[row + 1] = offset + len(distinct)
            positives.append((self.case_patient[member_positive], offset + inverse))
            if len(distinct) == 0:
                continue
            negative_scores = values[member_negative]
            slot = np.searchsorted(distinct, negative_scores, side="left")
            counted = slot < len(distinct)
            slot, member_negative, negative_scores = slot[counted], member_negative[counted], negative_scores[counted]
            tied = distinct[slot] == negative_scores
            negatives.append((self.case_patient[member_negative], 2 * (offset + slot) + tied))
        return (counts, positives, negatives), positive_offsets

    def _build_projection(self, entries, n_positive_columns: int) -> scipy.sparse.csr_matrix:
        """The sparse (columns x patients) matrix S; a patient's cases in one column add up."""
        self._count_slice = slice(0, 4 * self._n_rows)
        self._positive_slice = slice(4 * self._n_rows, 4 * self._n_rows + n_positive_columns)
        self._negative_slice = slice(self._positive_slice.stop, self._positive_slice.stop + 2 * n_positive_columns)
        patient_index, column_index = [], []
        for kind, start in zip(entries, (0, self._positive_slice.start, self._negative_slice.start)):
            for patients, columns in kind:
                patient_index.append(patients)
                column_index.append(columns + start)
        patients_all = np.concatenate(patient_index) if patient_index else np.zeros(0, dtype=np.int64)
        columns_all = np.concatenate(column_index) if column_index else np.zeros(0, dtype=np.int64)
        # COO -> CSR sums duplicate (column, patient) pairs.
        return scipy.sparse.coo_matrix(
            (np.ones(len(columns_all)), (columns_all, patients_all)),
            shape=(self._negative_slice.stop, len(self.patients)),
        ).tocsr()

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
        statistics = {"n": positives + negatives, "positives": positives, "negatives": negatives,
                      "tp": tp, "fp": fp, "tn": tn, "fn": fn}
        statistics.update(rates(tp, fp, tn, fn))
        statistics["auc"] = self._auc(projected, positives, negatives)
        return statistics

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
        """The subgroup table of one weighting (``index``) from :meth:`evaluate`'s output.

        ``n_patients`` is the number of distinct patients of each subgroup in the evaluation set.
        """
        table = self.rows.copy()
        table["n_patients"] = self.row_patients
        for name in COUNT_COLUMNS:
            table[name] = np.rint(statistics[name][index]).astype(np.int64)
        for name in RATE_METRICS:
            table[name] = statistics[name][index]
        if self.lesion_counts is not None:
            lesions, found = self.lesion_counts
            table["lesions"] = [int(lesions[self._membership[:, row]].sum()) for row in range(len(self.rows))]
            table["lesions_found"] = [int(found[self._membership[:, row]].sum()) for row in range(len(self.rows))]
            with np.errstate(invalid="ignore", divide="ignore"):
                table["lesion_hit_rate"] = np.where(table["lesions"] > 0, table["lesions_found"] / table["lesions"], np.nan)
        return table


def subgroup_metrics(
    records: pd.DataFrame,
    threshold: float,
    score: str = "volume",
    attributes: Sequence[str] = ATTRIBUTES,
) -> pd.DataFrame:
    """Detection metrics overall and per subgroup, one row per (attribute, group).

    Columns: attribute, group, n_patients, n, positives, negatives, tp, fp, tn, fn, sensitivity,
    specificity, f1, auc (ROC AUC of the continuous score), auc_binary ((sensitivity +
    specificity)/2, the BenchX tables' AUC), and when the records hold them the lesion-level hits
    lesions, lesions_found and lesion_hit_rate (found / lesions). Undefined metrics are NaN: sensitivity and auc without
    positives, specificity and auc without negatives, F1 only when TP+FP+FN = 0. Counts are always
    there.

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
