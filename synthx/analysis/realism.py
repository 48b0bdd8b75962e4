"""Realism of synthetic tumors per phase: radiomic features, two-sample tests with intervals, a quality filter.

Pure functions over (CT in HU, tumor mask, organ mask, spacing); no MLflow (the quality command logs
the tables). docs/explanation/synthx.md "Synthetic data" describes how they are read.

Per tumor (:func:`realism_features`):

- intensity: ``tumor_mean``, ``tumor_sd`` and ``contrast`` (tumor mean minus the mean of the organ
  rim within ``rim_mm`` of the tumor, as :mod:`synthx.analysis.quality`);
- texture: GLCM ``glcm_contrast`` and ``glcm_homogeneity`` (skimage ``graycomatrix``/``graycoprops``),
  2D per axial slice (last array axis) of the tumor's bounding box, distance 1 voxel, angles 0, 45,
  90 and 135 degrees, HU clipped to ``hu_window`` and quantized to ``levels`` grey levels; only pairs
  of two tumor voxels count, pooled over slices and angles into one matrix;
- boundary: ``edge_gradient``, the mean HU gradient magnitude (np.gradient, HU/mm) on a shell one
  voxel inside and one voxel outside the tumor (binary erosion and dilation). A pasted tumor with a
  seam has a step there; a real tumor fades into its organ;
- surround: ``shell_fat``, the share of the shell one voxel outside the tumor whose HU lie in the
  adipose range (-190 to -30 HU). A tumor drawn to the organ's border, in a thin gland such as the
  pancreas, borders fat where a real tumor of the gland is wrapped in gland tissue;
- shape and size: ``volume_ml`` (voxel count), ``sphericity`` (pi^(1/3) (6V)^(2/3) / A with A and V
  the area and volume of the marching-cubes surface, skimage) and ``solidity`` (that volume over its
  convex hull's, scipy).

Per phase, real versus another set (synthetic, or copy-paste when given; :func:`realism_table`):
the difference of means of each feature with a percentile bootstrap interval over tumors; a
classifier two-sample test (:func:`classifier_two_sample_test`: a standardized logistic regression
telling real from the other set, cross-validated AUC with DeLong's interval; 0.5 = indistinguishable);
the Frechet distance between the standardized feature vectors (:func:`frechet_distance`) with a
bootstrap interval. :func:`quality_filter` drops the synthetic cases a cross-fitted discriminator
scores above what real training tumors reach.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import pandas as pd
import scipy.linalg
import scipy.stats
from scipy import ndimage
from scipy.spatial import ConvexHull
from skimage.feature import graycomatrix, graycoprops
from skimage.measure import marching_cubes, mesh_surface_area

from lightning_modules.data.metadata import PHASES
from lightning_modules.evaluation.small_counts import delong_covariance

HU_WINDOW = (-175.0, 250.0)  # Touchstone HU window, as used for training
GLCM_ANGLES = (0.0, np.pi / 4, np.pi / 2, 3 * np.pi / 4)
# The radiomic vector the classifier and the Frechet distance use (volume enters as its logarithm).
FEATURES = ("contrast", "tumor_sd", "glcm_contrast", "glcm_homogeneity", "edge_gradient", "volume_ml", "sphericity", "solidity")
# Compared one by one beside FEATURES, but kept out of the radiomic vector: a fraction that is 0 for
# nearly every real tumor would let the classifier and the distance hinge on a few voxels.
SURROUND = ("shell_fat",)
FAT_HU = (-190.0, -30.0)  # the adipose tissue range of CT body-composition work
TABLE_COLUMNS = ["phase", "comparison", "metric", "n_real", "n_other", "real", "other", "value", "ci_low", "ci_high", "null",
                 "p_value", "method"]


def organ_rim(tumor: np.ndarray, organ: np.ndarray, spacing: Sequence[float], rim_mm: float) -> tuple[tuple[slice, ...], np.ndarray]:
    """The organ voxels within ``rim_mm`` of the tumor (outside it), as (a box, the rim mask inside that box)."""
    reach = np.ceil(rim_mm / np.asarray(spacing, dtype=np.float64)).astype(int) + 1
    coordinates = np.argwhere(tumor)
    lower = np.maximum(coordinates.min(axis=0) - reach, 0)
    upper = np.minimum(coordinates.max(axis=0) + reach + 1, tumor.shape)
    box = tuple(slice(int(a), int(b)) for a, b in zip(lower, upper))
    distance = ndimage.distance_transform_edt(~tumor[box], sampling=[float(s) for s in spacing])
    return box, (distance > 0) & (distance <= rim_mm) & np.asarray(organ, dtype=bool)[box]


def glcm_texture(ct: np.ndarray, tumor: np.ndarray, hu_window=HU_WINDOW, levels: int = 32) -> tuple[float, float]:
    """(GLCM contrast, GLCM homogeneity) of the tumor voxels, per axial slice, pooled; NaN without a voxel pair."""
    low, high = float(hu_window[0]), float(hu_window[1])
    quantized = 1 + np.floor((np.clip(ct, low, high) - low) / (high - low) * (levels - 1e-9)).astype(np.int64)
    quantized = np.where(tumor, quantized, 0)  # 0: outside the tumor, dropped from the matrix below
    pooled = np.zeros((levels, levels), dtype=np.float64)
    for k in np.flatnonzero(tumor.any(axis=(0, 1))):
        plane = quantized[:, :, k]
        rows, cols = np.flatnonzero(plane.any(axis=1)), np.flatnonzero(plane.any(axis=0))
        crop = np.pad(plane[rows[0] : rows[-1] + 1, cols[0] : cols[-1] + 1], 1).astype(np.uint8)
        matrix = graycomatrix(crop, distances=[1], angles=list(GLCM_ANGLES), levels=levels + 1, symmetric=True)
        pooled += matrix[1:, 1:, 0, :].sum(axis=-1)
    if pooled.sum() == 0:
        return math.nan, math.nan
    properties = (pooled / pooled.sum())[:, :, None, None]
    return float(graycoprops(properties, "contrast")[0, 0]), float(graycoprops(properties, "homogeneity")[0, 0])


def edge_gradient(ct: np.ndarray, tumor: np.ndarray, spacing: Sequence[float]) -> float:
    """Mean HU gradient magnitude (HU/mm) on the shell one voxel inside and one voxel outside the tumor."""
    coordinates = np.argwhere(tumor)
    box = tuple(slice(max(int(a) - 2, 0), int(b) + 3) for a, b in zip(coordinates.min(axis=0), coordinates.max(axis=0)))
    inside, image = tumor[box], np.asarray(ct, dtype=np.float64)[box]
    shell = ndimage.binary_dilation(inside) & ~ndimage.binary_erosion(inside)
    gradients = np.gradient(image, *[float(s) for s in spacing])
    magnitude = np.sqrt(sum(g * g for g in gradients))
    return float(magnitude[shell].mean())


def shell_fat(ct: np.ndarray, tumor: np.ndarray, fat_hu: Sequence[float] = FAT_HU) -> float:
    """The share of the shell one voxel outside the tumor (binary dilation) whose HU lie in ``fat_hu``."""
    coordinates = np.argwhere(tumor)
    box = tuple(slice(max(int(a) - 1, 0), int(b) + 2) for a, b in zip(coordinates.min(axis=0), coordinates.max(axis=0)))
    inside = tumor[box]
    shell = ndimage.binary_dilation(inside) & ~inside
    values = np.asarray(ct, dtype=np.float64)[box][shell]
    if values.size == 0:  # the tumor fills the scan up to its edges
        return math.nan
    return float(((values >= fat_hu[0]) & (values <= fat_hu[1])).mean())


def shape_features(tumor: np.ndarray, spacing: Sequence[float]) -> dict[str, float]:
    """Volume (ml, voxel count), sphericity and solidity of the marching-cubes surface of the tumor."""
    spacing = tuple(float(s) for s in spacing)
    coordinates = np.argwhere(tumor)
    lower, upper = coordinates.min(axis=0), coordinates.max(axis=0) + 1
    crop = np.pad(tumor[tuple(slice(int(a), int(b)) for a, b in zip(lower, upper))].astype(np.float32), 1)
    volume_mm3 = float(tumor.sum()) * float(np.prod(spacing))
    vertices, faces, _, _ = marching_cubes(crop, level=0.5, spacing=spacing)
    area = float(mesh_surface_area(vertices, faces))
    triangles = vertices[faces]
    mesh_volume = abs(float(np.einsum("ij,ij->i", triangles[:, 0], np.cross(triangles[:, 1], triangles[:, 2])).sum()) / 6.0)
    # The mask is padded, so the surface is closed around every voxel: its hull always has a volume.
    hull_volume = float(ConvexHull(vertices).volume)
    return {
        "volume_ml": volume_mm3 / 1000.0,
        # The surface's own volume, not the voxel count: a few-voxel tumor's marching-cubes surface
        # cuts its corners, and against the voxel volume its sphericity would exceed 1.
        "sphericity": math.pi ** (1 / 3) * (6 * mesh_volume) ** (2 / 3) / area if area > 0 else math.nan,
        "solidity": mesh_volume / hull_volume,
    }


def realism_features(
    ct: np.ndarray, tumor: np.ndarray, organ: np.ndarray, spacing: Sequence[float],
    rim_mm: float = 5.0, hu_window=HU_WINDOW, levels: int = 32,
) -> dict[str, float]:
    """Every per-tumor feature of :data:`FEATURES` (and ``tumor_mean``) for one non-empty tumor mask."""
    tumor = np.asarray(tumor, dtype=bool)
    if not tumor.any():
        raise ValueError("the tumor mask is empty")
    ct = np.asarray(ct, dtype=np.float64)
    values = ct[tumor]
    box, rim = organ_rim(tumor, organ, spacing, rim_mm)
    rim_values = ct[box][rim]
    glcm_contrast, glcm_homogeneity = glcm_texture(ct, tumor, hu_window, levels)
    features = {
        "tumor_mean": float(values.mean()),
        "tumor_sd": float(values.std()),
        "contrast": float(values.mean() - rim_values.mean()) if rim_values.size else math.nan,
        "glcm_contrast": glcm_contrast,
        "glcm_homogeneity": glcm_homogeneity,
        "edge_gradient": edge_gradient(ct, tumor, spacing),
        "shell_fat": shell_fat(ct, tumor),
    }
    features.update(shape_features(tumor, spacing))
    return features


# --- two-sample statistics ---------------------------------------------------------------------


def bootstrap_mean_difference(real, other, resamples: int = 2000, confidence: float = 0.95, seed: int = 0) -> tuple[float, float, float]:
    """mean(other) - mean(real) and its percentile bootstrap interval, each set resampled over its tumors.

    NaNs are left out; (NaN, NaN, NaN) when a set has no value, and a NaN interval when a set has
    one (resampling one tumor says nothing about the spread).
    """
    real, other = _finite(real), _finite(other)
    if real.size == 0 or other.size == 0:
        return math.nan, math.nan, math.nan
    if real.size < 2 or other.size < 2:
        return float(other.mean() - real.mean()), math.nan, math.nan
    rng = np.random.default_rng(seed)
    differences = other[rng.integers(other.size, size=(resamples, other.size))].mean(axis=1) - real[
        rng.integers(real.size, size=(resamples, real.size))].mean(axis=1)
    tail = (1.0 - confidence) / 2 * 100
    low, high = np.percentile(differences, [tail, 100 - tail])
    return float(other.mean() - real.mean()), float(low), float(high)


def classifier_scores(x_train: np.ndarray, y_train: np.ndarray, x_score: np.ndarray) -> np.ndarray:
    """P(synthetic) of ``x_score`` from a standardized, L2-regularized logistic regression fitted on the training rows."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    model = make_pipeline(StandardScaler(), LogisticRegression(C=1.0, max_iter=2000))
    model.fit(x_train, y_train)
    return model.predict_proba(x_score)[:, 1]


def out_of_fold_scores(real: np.ndarray, other: np.ndarray, folds: int = 5, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(labels, scores): every tumor scored by a classifier trained on the other folds (stratified, cross-fitted).

    Labels are 0 for ``real`` rows (first) and 1 for ``other`` rows (after them). Needs two rows of each set.
    """
    from sklearn.model_selection import StratifiedKFold

    x = np.vstack([real, other])
    y = np.r_[np.zeros(len(real), dtype=int), np.ones(len(other), dtype=int)]
    splits = StratifiedKFold(n_splits=max(2, min(folds, len(real), len(other))), shuffle=True, random_state=seed)
    scores = np.empty(len(y))
    for train, held_out in splits.split(x, y):
        scores[held_out] = classifier_scores(x[train], y[train], x[held_out])
    return y, scores


def classifier_two_sample_test(real, other, folds: int = 5, confidence: float = 0.95, seed: int = 0,
                               with_p: bool = False) -> tuple[float, ...]:
    """Cross-validated AUC of telling ``other`` from ``real`` feature rows, with DeLong's interval (clipped to [0, 1]).

    The AUC pools the out-of-fold scores; 0.5 means the sets cannot be told apart. With ``with_p``,
    a fourth value: the two-sided normal p of AUC = 0.5 with DeLong's standard error. NaNs with fewer
    than two rows in a set.
    """
    real, other = np.asarray(real, dtype=float), np.asarray(other, dtype=float)
    if len(real) < 2 or len(other) < 2:
        return (math.nan,) * (4 if with_p else 3)
    y, scores = out_of_fold_scores(real, other, folds, seed)
    (auc,), covariance = delong_covariance(y, scores)
    se = math.sqrt(max(float(covariance[0, 0]), 0.0))
    half = scipy.stats.norm.ppf(0.5 + confidence / 2) * se
    result = (float(auc), max(0.0, float(auc - half)), min(1.0, float(auc + half)))
    if not with_p:
        return result
    p = float(2 * scipy.stats.norm.sf(abs(auc - 0.5) / se)) if se > 0 else float(auc == 0.5)
    return (*result, p)


def frechet_distance(a, b) -> float:
    """Frechet distance between Gaussians fitted to two sets of feature rows: |mu_a - mu_b|^2 + Tr(S_a + S_b - 2 (S_a S_b)^(1/2)).

    The trace of the root is taken as that of (S_a^(1/2) S_b S_a^(1/2))^(1/2), the same number for
    covariance matrices, from eigenvalues of symmetric matrices (scipy.linalg.eigh): exact when a
    covariance is singular (fewer tumors than features), where a general matrix square root is not.
    """
    a, b = np.atleast_2d(np.asarray(a, dtype=float)), np.atleast_2d(np.asarray(b, dtype=float))
    cov_a, cov_b = np.atleast_2d(np.cov(a, rowvar=False)), np.atleast_2d(np.cov(b, rowvar=False))
    values, vectors = scipy.linalg.eigh(cov_a)
    root_a = (vectors * np.sqrt(np.clip(values, 0.0, None))) @ vectors.T
    product = scipy.linalg.eigvalsh(root_a @ cov_b @ root_a)
    trace_root = float(np.sqrt(np.clip(product, 0.0, None)).sum())
    shift = float(np.sum((a.mean(axis=0) - b.mean(axis=0)) ** 2))
    return max(shift + float(np.trace(cov_a) + np.trace(cov_b)) - 2.0 * trace_root, 0.0)


def standardized(real: np.ndarray, *others: np.ndarray) -> list[np.ndarray]:
    """Every set scaled by the pooled mean and SD per feature (a constant feature is only centred).

    Pooled rather than the real set's own: a phase with two real tumors would otherwise divide by
    an SD of two values, and the same scale for both sets keeps the distance symmetric.
    """
    pooled = np.vstack([real, *others])
    mean, sd = pooled.mean(axis=0), pooled.std(axis=0)
    sd = np.where(sd > 0, sd, 1.0)
    return [(x - mean) / sd for x in (real, *others)]


def bootstrap_frechet(real, other, resamples: int = 200, confidence: float = 0.95, seed: int = 0) -> tuple[float, float, float]:
    """Frechet distance of the feature rows standardized (:func:`standardized`), with a percentile bootstrap interval.

    The plug-in distance is biased upward at small counts (sampling noise in the covariances), so
    read it against the distance of a set known to match. (NaN, NaN, NaN) with fewer than two rows in a set.
    """
    real, other = np.asarray(real, dtype=float), np.asarray(other, dtype=float)
    if len(real) < 2 or len(other) < 2:
        return math.nan, math.nan, math.nan
    z_real, z_other = standardized(real, other)
    rng = np.random.default_rng(seed)
    draws = [frechet_distance(z_real[rng.integers(len(real), size=len(real))], z_other[rng.integers(len(other), size=len(other))])
             for _ in range(resamples)]
    tail = (1.0 - confidence) / 2 * 100
    low, high = np.percentile(draws, [tail, 100 - tail])
    return frechet_distance(z_real, z_other), float(low), float(high)


def permutation_frechet(real, other, permutations: int = 200, seed: int = 0) -> tuple[float, float]:
    """(mean, p): the Frechet distance expected between two sets of these sizes drawn from the same
    tumors (real and other pooled, labels permuted), and the share of permutations at least as far
    as the observed sets (with the observed one counted). NaNs with fewer than two rows in a set.
    """
    real, other = np.asarray(real, dtype=float), np.asarray(other, dtype=float)
    if len(real) < 2 or len(other) < 2:
        return math.nan, math.nan
    z_real, z_other = standardized(real, other)
    observed = frechet_distance(z_real, z_other)
    pooled, rng = np.vstack([z_real, z_other]), np.random.default_rng(seed)
    draws = []
    for _ in range(permutations):
        order = rng.permutation(len(pooled))
        first, second = pooled[order[: len(real)]], pooled[order[len(real) :]]
        draws.append(frechet_distance(*standardized(first, second)))
    return float(np.mean(draws)), float((1 + sum(d >= observed for d in draws)) / (1 + permutations))


def feature_matrix(frame: pd.DataFrame, columns: Sequence[str] = FEATURES) -> np.ndarray:
    """The rows' radiomic vectors (``volume_ml`` as its logarithm); rows with a NaN feature must be dropped first."""
    matrix = frame[list(columns)].to_numpy(dtype=float).copy()
    if "volume_ml" in columns:
        index = list(columns).index("volume_ml")
        matrix[:, index] = np.log(np.maximum(matrix[:, index], 1e-6))
    return matrix


def realism_table(features: pd.DataFrame, columns: Sequence[str] = FEATURES, folds: int = 5, seed: int = 0,
                  embeddings: np.ndarray | None = None) -> pd.DataFrame:
    """Per phase, real tumors against each other kind (``synthetic``, ``copy_paste``): one row per metric.

    Args:
        features: one row per tumor with ``kind`` (``real`` or another set's name), ``phase`` and the
            feature ``columns``.
        columns: the per-tumor features compared one by one and stacked into the radiomic vector.
        folds: cross-validation folds of the classifier test.
        seed: bootstrap and fold seed.
        embeddings: optional encoder features, one row per row of ``features`` (in order); when
            given, the Frechet distance is computed on them
            (method ``frechet_encoder``) besides the radiomic one.

    Returns:
        :data:`TABLE_COLUMNS`: for a feature, ``real``/``other`` are the means and ``value`` their
        difference (other - real) with a bootstrap interval; ``classifier_auc`` is the cross-validated
        AUC with DeLong's interval; ``frechet_radiomic`` (and ``frechet_encoder``) the distance with a
        bootstrap interval. ``null`` is what a set like the real one scores (0, 0.5, and for a
        distance the mean over label permutations, its small-sample bias) and ``p_value`` the test
        against it (DeLong normal p for the AUC, permutation p for a distance; NaN for a feature,
        whose interval answers). Tumors with a NaN feature are left out of the classifier and distances.
    """
    rows = []
    features = features.reset_index(drop=True)
    phases = [p for p in PHASES if p in set(features["phase"])] + sorted(set(features["phase"]) - set(PHASES))
    for phase in phases:
        in_phase = features[features["phase"] == phase]
        real = in_phase[in_phase["kind"] == "real"]
        for kind in sorted(set(in_phase["kind"]) - {"real"}):
            other = in_phase[in_phase["kind"] == kind]
            base = {"phase": phase, "comparison": kind}
            for column in [*columns, *(c for c in SURROUND if c in features.columns and c not in columns)]:
                value, low, high = bootstrap_mean_difference(real[column], other[column], seed=seed)
                rows.append({**base, "metric": column, "n_real": int(real[column].notna().sum()),
                             "n_other": int(other[column].notna().sum()), "real": _mean(real[column]),
                             "other": _mean(other[column]), "value": value, "ci_low": low, "ci_high": high,
                             "null": 0.0, "p_value": math.nan, "method": "mean difference, bootstrap"})
            complete_real, complete_other = real.dropna(subset=list(columns)), other.dropna(subset=list(columns))
            counts = {"n_real": len(complete_real), "n_other": len(complete_other), "real": math.nan, "other": math.nan}
            x_real, x_other = feature_matrix(complete_real, columns), feature_matrix(complete_other, columns)
            auc = classifier_two_sample_test(x_real, x_other, folds=folds, seed=seed, with_p=True)
            rows.append({**base, "metric": "classifier_auc", **counts, **dict(zip(("value", "ci_low", "ci_high", "p_value"), auc)),
                         "null": 0.5, "method": f"logistic regression, {folds}-fold AUC, DeLong"})
            rows.append({**base, "metric": "frechet_radiomic", **counts, **_frechet_row(x_real, x_other, seed),
                         "method": "standardized radiomic vector, bootstrap, permutation"})
            if embeddings is not None:
                vectors = np.asarray(embeddings, dtype=float)
                rows.append({**base, "metric": "frechet_encoder", "n_real": len(real), "n_other": len(other),
                             "real": math.nan, "other": math.nan, **_frechet_row(vectors[real.index], vectors[other.index], seed),
                             "method": "detector encoder bottleneck, bootstrap, permutation"})
    return pd.DataFrame(rows, columns=TABLE_COLUMNS)


def quality_filter(features: pd.DataFrame, columns: Sequence[str] = FEATURES, real_quantile: float = 0.95,
                   folds: int = 5, seed: int = 0) -> pd.DataFrame:
    """Per phase, drop the synthetic tumors a cross-fitted real-vs-synthetic discriminator spots.

    Every tumor, real or synthetic, is scored by a discriminator (:func:`classifier_scores`) trained
    on the other folds only, so no case is scored by a model that saw it. The threshold is the
    ``real_quantile`` quantile of the real training tumors' scores: a synthetic tumor that looks more
    synthetic than that share of real tumors is dropped. A phase with fewer than two real or two
    synthetic tumors cannot be filtered, nor can a tumor with a NaN feature (a flat one has no
    solidity): those synthetic cases are kept with a NaN score.

    Args:
        features: rows with ``case_id``, ``kind`` (``real`` or ``synthetic``), ``phase`` and the ``columns``.

    Returns:
        one row per synthetic tumor: ``case_id``, ``phase``, ``score``, ``threshold``, ``kept``.
    """
    if not 0.0 < real_quantile <= 1.0:
        raise ValueError(f"real_quantile must be in (0, 1], got {real_quantile}")
    rows = []
    for phase, in_phase in features.groupby("phase", sort=False):
        complete = in_phase.dropna(subset=list(columns))
        real, synthetic = complete[complete["kind"] == "real"], complete[complete["kind"] == "synthetic"]
        scores, threshold = {}, math.nan
        if len(real) >= 2 and len(synthetic) >= 2:
            y, oof = out_of_fold_scores(feature_matrix(real, columns), feature_matrix(synthetic, columns), folds, seed)
            threshold = float(np.quantile(oof[y == 0], real_quantile))
            scores = dict(zip(synthetic["case_id"], oof[y == 1]))
        for case_id in in_phase.loc[in_phase["kind"] == "synthetic", "case_id"]:
            score = float(scores.get(case_id, math.nan))
            rows.append({"case_id": case_id, "phase": phase, "score": score, "threshold": threshold,
                         "kept": bool(not np.isfinite(score) or score <= threshold)})
    return pd.DataFrame(rows, columns=["case_id", "phase", "score", "threshold", "kept"])


# What realism_summary shows per feature: column title and number format.
SUMMARY_FEATURES = {
    "contrast": ("Contrast to organ (HU)", "{:+.0f}"),
    "tumor_sd": ("Tumor HU SD", "{:.0f}"),
    "glcm_contrast": ("GLCM contrast", "{:.2f}"),
    "glcm_homogeneity": ("GLCM homogeneity", "{:.2f}"),
    "edge_gradient": ("Edge gradient (HU/mm)", "{:.1f}"),
    "shell_fat": ("Fat around it", "{:.0%}"),
    "volume_ml": ("Volume (ml)", "{:.1f}"),
    "sphericity": ("Sphericity", "{:.2f}"),
    "solidity": ("Solidity", "{:.2f}"),
}


def realism_summary(table: pd.DataFrame, comparison: str = "synthetic") -> pd.DataFrame:
    """One display row per phase of a :func:`realism_table` for one comparison, as text.

    A feature reads ``real / other [low, high]`` with the interval of the difference (other - real);
    ``Real vs other AUC`` the classifier AUC with DeLong's interval; the Frechet distances with their
    bootstrap intervals; each of those three with its ``null`` level and p. A difference whose
    interval excludes 0 is marked ``*``. "-" is undefined.
    """
    rows = []
    chosen = table[table["comparison"] == comparison]
    for phase in dict.fromkeys(chosen["phase"]):
        metrics = chosen[chosen["phase"] == phase].set_index("metric")
        first = metrics.iloc[0]
        row = {"Phase": phase, f"Tumors real / {comparison}": f"{int(first['n_real'])} / {int(first['n_other'])}"}
        for name, (title, number) in SUMMARY_FEATURES.items():
            if name in metrics.index:
                m = metrics.loc[name]
                flag = "*" if m["ci_low"] > 0 or m["ci_high"] < 0 else ""
                row[title] = (f"{_text(m['real'], number)} / {_text(m['other'], number)} "
                              f"[{_text(m['ci_low'], '{:+.2f}')}, {_text(m['ci_high'], '{:+.2f}')}]{flag}")
        for name, title, number in (("classifier_auc", f"Real vs {comparison} AUC", "{:.2f}"),
                                    ("frechet_radiomic", "Frechet (radiomic)", "{:.2f}"),
                                    ("frechet_encoder", "Frechet (detector encoder)", "{:.2f}")):
            if name in metrics.index:
                m = metrics.loc[name]
                row[title] = (f"{_text(m['value'], number)} [{_text(m['ci_low'], number)}, {_text(m['ci_high'], number)}] "
                              f"(same-tumor level {_text(m['null'], number)}, p {_text(m['p_value'], '{:.3f}')})")
        rows.append(row)
    return pd.DataFrame(rows)


def _frechet_row(real: np.ndarray, other: np.ndarray, seed: int) -> dict[str, float]:
    value, low, high = bootstrap_frechet(real, other, seed=seed)
    null, p = permutation_frechet(real, other, seed=seed)
    return {"value": value, "ci_low": low, "ci_high": high, "null": null, "p_value": p}


def _text(value, number: str) -> str:
    return "-" if value is None or not np.isfinite(value) else number.format(value)


def _finite(values) -> np.ndarray:
    array = np.asarray(values, dtype=float)
    return array[np.isfinite(array)]


def _mean(values) -> float:
    finite = _finite(values)
    return float(finite.mean()) if finite.size else math.nan
