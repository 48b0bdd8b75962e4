"""The audit's source layer: can acquisition metadata alone predict the tumor label?

Gradient-boosted trees trained on acquisition metadata alone (spacing, shape, dtype, file size,
scanner, cohort, phase) predict the tumor label on train and are scored on test by balanced
accuracy. Well above chance (default > 0.65, and p < 0.05 by a label-permutation test) is a warning
naming the features that carry it (permutation importance): a model could learn the site or
protocol instead of the tumor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

HEADER_FEATURES_NUMERIC = ("spacing_x", "spacing_y", "spacing_z", "shape_x", "shape_y", "shape_z", "file_size")
HEADER_FEATURES_CATEGORICAL = ("dtype", "scanner", "cohort", "phase")


@dataclass
class HeaderLeakage:
    """Result of the source/header classifier (layer 3)."""

    balanced_accuracy: float = math.nan
    p_value: float = math.nan
    n_train: int = 0
    n_eval: int = 0
    evaluated_on: str = ""
    flagged: bool = False
    importances: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(columns=["feature", "importance", "std"]))
    carrying: list[str] = field(default_factory=list)
    skipped: str = ""


def header_leakage(
    features: pd.DataFrame,
    labels: pd.Series,
    splits: pd.Series,
    seed: int = 0,
    min_balanced_accuracy: float = 0.65,
    alpha: float = 0.05,
    n_permutations: int = 2000,
    min_cases: int = 10,
) -> HeaderLeakage:
    """Can acquisition metadata alone predict the tumor label? Train on ``train``, score on ``test``.

    Gradient-boosted trees (native categorical splits) on the features is fitted on the training cases
    and scored by balanced accuracy on the test cases (on val + test when test lacks a class).
    Significance: the fitted predictions against ``n_permutations`` shuffles of the evaluation
    labels. Flagged when balanced accuracy > ``min_balanced_accuracy`` and p < ``alpha``; the
    features carrying it are those whose permutation importance is positive beyond its spread.

    Args:
        features: one row per case, columns from :data:`HEADER_FEATURES_NUMERIC` and
            :data:`HEADER_FEATURES_CATEGORICAL` (missing ones are left out).
        labels: tumor label per case (0/1; others are left out).
        splits: ``train``/``val``/``test`` per case.
    """
    result = HeaderLeakage()
    known = labels.isin([0, 1]).to_numpy()
    features, labels, splits = features[known], labels[known].astype(int), splits[known]
    train = (splits == "train").to_numpy()
    evaluation, evaluated_on = (splits == "test").to_numpy(), "test"
    if labels[evaluation].nunique() < 2:
        evaluation, evaluated_on = splits.isin(["val", "test"]).to_numpy(), "val+test"
    result.n_train, result.n_eval, result.evaluated_on = int(train.sum()), int(evaluation.sum()), evaluated_on
    if train.sum() < min_cases or labels[train].nunique() < 2:
        present = sorted(int(v) for v in labels[train].unique())
        result.skipped = (
            f"needs {min_cases}+ training cases with both labels (has {int(train.sum())}, labels {present})"
        )
        return result
    if evaluation.sum() < 4 or labels[evaluation].nunique() < 2:
        result.skipped = f"needs evaluation cases with both labels (has {int(evaluation.sum())})"
        return result

    # scikit-learn is imported here, not at module level: training imports the audit package for
    # its fast leakage check, which never needs the classifier.
    from sklearn.inspection import permutation_importance
    from sklearn.metrics import balanced_accuracy_score

    model, matrix, columns = _fit(features, labels, train, seed)
    truth = labels[evaluation].to_numpy()
    predicted = model.predict(matrix[evaluation])
    result.balanced_accuracy = float(balanced_accuracy_score(truth, predicted))
    result.p_value = _permutation_p_value(truth, predicted, result.balanced_accuracy, n_permutations, seed)
    importance = permutation_importance(
        model, matrix[evaluation], truth, scoring="balanced_accuracy", n_repeats=10, random_state=seed, n_jobs=1
    )
    result.importances = (
        pd.DataFrame({"feature": columns, "importance": importance.importances_mean, "std": importance.importances_std})
        .sort_values("importance", ascending=False)
        .reset_index(drop=True)
    )
    result.flagged = result.balanced_accuracy > min_balanced_accuracy and result.p_value < alpha
    carrying = result.importances[result.importances["importance"] > np.maximum(result.importances["std"], 0.01)]
    result.carrying = list(carrying["feature"]) or list(result.importances["feature"][:3])
    return result


def _fit(features: pd.DataFrame, labels: pd.Series, train: np.ndarray, seed: int):
    """Gradient-boosted trees fitted on the training rows; returns the model, the feature matrix
    of every row and its column names."""
    from sklearn.ensemble import HistGradientBoostingClassifier
    from sklearn.preprocessing import OrdinalEncoder

    categorical = [c for c in HEADER_FEATURES_CATEGORICAL if c in features.columns]
    numeric = [c for c in HEADER_FEATURES_NUMERIC if c in features.columns]
    # Categories as integer codes for the trees' native categorical splits (a category unseen in
    # train becomes missing); a plain array keeps the many predictions of the importance cheap.
    encoder = OrdinalEncoder(
        handle_unknown="use_encoded_value", unknown_value=np.nan, encoded_missing_value=np.nan, max_categories=250
    )
    codes = encoder.fit(features.loc[train, categorical].astype(str)).transform(features[categorical].astype(str))
    matrix = np.column_stack([codes, features[numeric].to_numpy(dtype=float)])
    # Gradient-boosted trees, as in the audit paper; small leaves because cohorts can be small.
    model = HistGradientBoostingClassifier(
        max_iter=100,
        min_samples_leaf=5,
        class_weight="balanced",
        early_stopping=False,
        categorical_features=[True] * len(categorical) + [False] * len(numeric),
        random_state=seed,
    )
    model.fit(matrix[train], labels[train])
    return model, matrix, categorical + numeric


def _permutation_p_value(truth: np.ndarray, predicted: np.ndarray, observed: float, n_permutations: int, seed: int) -> float:
    """The fitted predictions against ``n_permutations`` shuffles of the evaluation labels."""
    rng = np.random.default_rng(seed)
    shuffled = np.stack([rng.permutation(truth) for _ in range(n_permutations)])
    positive = shuffled == 1
    sensitivity = ((predicted == 1) & positive).sum(axis=1) / positive.sum(axis=1)
    specificity = ((predicted == 0) & ~positive).sum(axis=1) / (~positive).sum(axis=1)
    null = (sensitivity + specificity) / 2
    return float((1 + np.count_nonzero(null >= observed - 1e-12)) / (1 + n_permutations))
