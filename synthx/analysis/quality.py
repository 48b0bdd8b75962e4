"""How good are SynthX tumors? Intensity statistics, condition faithfulness and diversity versus real tumors.

Compares the synthetic tumors of a SynthX output cohort (``synthetic=1`` rows) with the real tumors
of the real cohort's TRAINING split, per phase and per subgroup:

- Intensity: per tumor, the HU mean, SD and percentiles, and the contrast against a rim of the
  surrounding organ (the tumor dilated by ``rim_mm`` minus the tumor, inside the organ mask):
  ``contrast = mean HU(tumor) - mean HU(rim)``. Per group, the mean of those numbers for real and
  synthetic tumors and two Wasserstein distances (scipy.stats.wasserstein_distance): between the
  tumor HU distributions (each tumor summarized by its quantiles and weighted equally, so one large
  tumor does not dominate) and between the per-tumor contrasts.
- Condition faithfulness: a phase classifier (standardized logistic regression) trained on the
  real training tumors' intensity features, scoring each synthetic tumor against the phase it was
  generated for; accuracy per requested phase. The features are the TUMOR's HU statistics only:
  the rim is the real canvas, whose phase is the requested phase by construction, so rim features
  would make the check pass whatever the generator did. The real tumors' cross-validated accuracy
  is reported beside it as the ceiling the synthetic accuracy can be read against.
- Diversity: the mean pairwise normalized cross-correlation (NCC) of fixed-size HU patches centred
  on the tumors, per condition (phase, sex, age band), for synthetic and for real tumors. Synthetic
  NCC far above the real one means the generator repeats itself.
- Realism (:mod:`synthx.analysis.realism`): texture, boundary and shape per tumor; per phase, differences
  with intervals, a classifier two-sample test and Frechet distances (also for a copy-paste cohort).
- A grid of example slices (real and synthetic per phase) as a matplotlib figure.

Run (:mod:`synthx.commands.synthx_quality`, which logs the report to MLflow)::

    benchx synthx-quality --root data/phantom --split splits/phantom.csv --synthetic data/synthetic \
        [--tracking-uri sqlite:///mlflow.db --run-id <generation run id> --out reports/synthx_quality]
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import nibabel as nib
import numpy as np
import pandas as pd
from scipy import ndimage
from scipy.stats import wasserstein_distance

from lightning_modules.data.cohort import Case, Cohort, load_cohort
from lightning_modules.data.metadata import AGE_BAND_NAMES, PHASES, SEXES, UNKNOWN
from lightning_modules.data.splits import load_split
from synthx.analysis.realism import FEATURES as REALISM_FEATURES, organ_rim, SURROUND, realism_features, realism_table


PERCENTILES = (5, 25, 50, 75, 95)
# Per-tumor quantiles that stand for its HU distribution in the Wasserstein distance.
_QUANTILE_LEVELS = np.linspace(0.0, 1.0, 101)
PHASE_FEATURES = ("tumor_mean", "tumor_sd", "tumor_p5", "tumor_p50", "tumor_p95")
# Attributes the intensity table is grouped by; "a:b" rows are the cross of two attributes.
GROUPINGS: tuple[tuple[str, ...], ...] = ((), ("phase",), ("sex",), ("age_band",), ("phase", "sex"), ("phase", "age_band"))
DISPLAY_WINDOW = (-175.0, 250.0)  # Touchstone HU window, as used for training
LOGGED_STATISTICS = (
    "contrast_real",
    "contrast_synthetic",
    "tumor_mean_real",
    "tumor_mean_synthetic",
    # The SD inside the tumor: texture. A generator unsure of a rare condition paints mottled tumors
    # whose mean contrast can still look right.
    "tumor_sd_real",
    "tumor_sd_synthetic",
    "wasserstein_hu",
    "wasserstein_contrast",
)


class QualityError(ValueError):
    """A quality report cannot be computed; the message names the case, the file and the problem."""


@dataclass
class TumorRecord:
    """The intensity statistics of one tumor (one case's lesion mask) and its subgroup attributes."""

    case_id: str
    synthetic: int
    phase: str
    sex: str
    age_band: str
    cohort: str
    voxels: int
    rim_voxels: int
    stats: dict[str, float]
    realism: dict[str, float]
    quantiles: np.ndarray = field(repr=False)
    patch: np.ndarray = field(repr=False)
    slice_image: np.ndarray = field(repr=False)
    slice_mask: np.ndarray = field(repr=False)
    embedding: np.ndarray | None = field(repr=False, default=None)


@dataclass
class QualityReport:
    """Everything :func:`quality_report` measured (``realism``: :func:`synthx.analysis.realism.realism_table`)."""

    per_tumor: pd.DataFrame
    intensity: pd.DataFrame
    faithfulness: pd.DataFrame
    diversity: pd.DataFrame
    realism: pd.DataFrame
    figure: object
    records: list[TumorRecord] = field(repr=False, default_factory=list)


def tumor_statistics(
    ct: np.ndarray,
    tumor: np.ndarray,
    organ: np.ndarray,
    spacing: Sequence[float],
    rim_mm: float = 5.0,
) -> tuple[dict[str, float], np.ndarray, int]:
    """HU statistics of one tumor and its contrast against the surrounding organ rim.

    Args:
        ct: the CT in HU.
        tumor: the tumor mask (non-empty).
        organ: the organ mask; the rim is kept inside it (whether or not it includes the tumor).
        spacing: voxel size in mm per array axis (the rim is ``rim_mm`` thick in every direction).
        rim_mm: thickness of the rim.

    Returns:
        (statistics, the tumor's HU quantiles at :data:`_QUANTILE_LEVELS`, number of rim voxels).
        ``rim_mean`` and ``contrast`` are NaN when the rim is empty (the tumor fills its organ).
    """
    tumor = np.asarray(tumor, dtype=bool)
    values = np.asarray(ct, dtype=np.float64)[tumor]
    if values.size == 0:
        raise ValueError("the tumor mask is empty")
    box, rim = organ_rim(tumor, organ, spacing, rim_mm)
    rim_values = np.asarray(ct, dtype=np.float64)[box][rim]
    stats = {"tumor_mean": float(values.mean()), "tumor_sd": float(values.std())}
    for level, value in zip(PERCENTILES, np.percentile(values, PERCENTILES)):
        stats[f"tumor_p{level}"] = float(value)
    stats["rim_mean"] = float(rim_values.mean()) if rim_values.size else math.nan
    stats["contrast"] = stats["tumor_mean"] - stats["rim_mean"]
    return stats, np.quantile(values, _QUANTILE_LEVELS), int(rim_values.size)


def centred_patch(volume: np.ndarray, centre: Sequence[int], size: int) -> np.ndarray:
    """A ``size``-cube of ``volume`` centred on ``centre``, edge-padded where it leaves the volume."""
    half = size // 2
    padded = np.pad(volume, half + 1, mode="edge")
    start = [int(c) + 1 for c in centre]  # shift for the padding, minus half, plus half
    return padded[tuple(slice(s, s + size) for s in start)].astype(np.float32)


def normalized_cross_correlation(a: np.ndarray, b: np.ndarray) -> float:
    """NCC of two equally shaped arrays (Pearson correlation of their values); NaN if one is constant."""
    a = np.asarray(a, dtype=np.float64).ravel() - np.mean(a)
    b = np.asarray(b, dtype=np.float64).ravel() - np.mean(b)
    denominator = np.sqrt((a * a).sum() * (b * b).sum())
    return float((a * b).sum() / denominator) if denominator > 0 else math.nan


def collect_tumors(
    cohort: Cohort,
    case_ids: Sequence[str],
    synthetic: int,
    lesion_class: str = "pancreatic_lesion",
    organ_class: str = "pancreas",
    rim_mm: float = 5.0,
    patch_size: int = 16,
    embed=None,
) -> list[TumorRecord]:
    """Read each case's CT, lesion and organ masks and measure its tumor (cases without a lesion voxel are skipped).

    Each record carries the intensity statistics and the :func:`synthx.analysis.realism.realism_features`.

    Args:
        cohort: the cohort holding the cases.
        case_ids: the cases to measure.
        synthetic: 1 for SynthX cases, 0 for real ones (recorded on each record).
        lesion_class / organ_class: the mask names of the tumor and its organ.
        rim_mm: rim thickness (see :func:`tumor_statistics`).
        patch_size: edge of the cube (voxels) used for diversity.
        embed: optionally [(CT, tumor)] -> features (:func:`synthx.analysis.realism_encoder.encoder_embedder`).
    """
    records = []
    for case_id in case_ids:
        case = cohort.case(case_id)
        ct, spacing = _load_ct(case)
        tumor = _load_mask(case, lesion_class, ct.shape, required=False)
        if tumor is None or not tumor.any():
            continue
        organ = _load_mask(case, organ_class, ct.shape, required=True)
        stats, quantiles, rim_voxels = tumor_statistics(ct, tumor, organ, spacing, rim_mm)
        centre = np.round(ndimage.center_of_mass(tumor)).astype(int)
        metadata = case.metadata
        records.append(
            TumorRecord(
                case_id=case_id,
                synthetic=synthetic,
                phase=str(metadata.get("phase", UNKNOWN)),
                sex=str(metadata.get("sex", UNKNOWN)),
                age_band=str(metadata.get("age_band", UNKNOWN)),
                cohort=str(metadata.get("cohort", UNKNOWN)),
                voxels=int(tumor.sum()),
                rim_voxels=rim_voxels,
                stats=stats,
                realism=realism_features(ct, tumor, organ, spacing, rim_mm),
                quantiles=quantiles,
                patch=centred_patch(ct, centre, patch_size),
                slice_image=_crop_slice(ct, centre, 2 * patch_size),
                slice_mask=_crop_slice(tumor.astype(np.float32), centre, 2 * patch_size),
                embedding=embed([(ct, tumor)])[0] if embed is not None else None,
            )
        )
    return records


def intensity_table(records: Sequence[TumorRecord]) -> pd.DataFrame:
    """Real versus synthetic intensity statistics per group (see :data:`GROUPINGS`), with Wasserstein distances.

    Groups whose value is Unknown are left out. A statistic of a side with no tumor is NaN and its
    count is 0, so an empty comparison is visible as such rather than as 0.
    """
    rows = []
    for attributes in GROUPINGS:
        keys = sorted(
            {tuple(getattr(r, a) for a in attributes) for r in records if all(getattr(r, a) != UNKNOWN for a in attributes)},
            key=_group_order(attributes),
        )
        for key in keys:
            members = [r for r in records if tuple(getattr(r, a) for a in attributes) == key]
            real = [r for r in members if r.synthetic == 0]
            synthetic = [r for r in members if r.synthetic == 1]
            row = {
                "attribute": ":".join(attributes) or "overall",
                "group": ":".join(key) or "all",
                "n_real": len(real),
                "n_synthetic": len(synthetic),
            }
            for name in ("tumor_mean", "tumor_sd", "tumor_p5", "tumor_p50", "tumor_p95", "rim_mean", "contrast"):
                row[f"{name}_real"] = _nanmean([r.stats[name] for r in real])
                row[f"{name}_synthetic"] = _nanmean([r.stats[name] for r in synthetic])
            row["wasserstein_hu"] = _wasserstein([r.quantiles for r in real], [r.quantiles for r in synthetic])
            real_contrast = [r.stats["contrast"] for r in real if np.isfinite(r.stats["contrast"])]
            synthetic_contrast = [r.stats["contrast"] for r in synthetic if np.isfinite(r.stats["contrast"])]
            row["wasserstein_contrast"] = (
                float(wasserstein_distance(real_contrast, synthetic_contrast)) if real_contrast and synthetic_contrast else math.nan
            )
            rows.append(row)
    return pd.DataFrame(rows)


def phase_faithfulness(records: Sequence[TumorRecord], seed: int = 0) -> pd.DataFrame:
    """Accuracy, per requested phase, of a phase classifier trained on real tumors and applied to synthetic ones.

    Returns one row per phase with synthetic tumors: ``n_synthetic``, ``accuracy`` (NaN with a
    ``note`` when no classifier can be trained: real tumors of fewer than two phases) and the real
    tumors' cross-validated accuracy ``real_cv_accuracy`` for that phase (NaN when a phase has fewer
    real tumors than folds allow).
    """
    from sklearn.linear_model import LogisticRegression
    from sklearn.model_selection import StratifiedKFold, cross_val_predict
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    real = [r for r in records if r.synthetic == 0 and r.phase != UNKNOWN]
    synthetic = [r for r in records if r.synthetic == 1 and r.phase != UNKNOWN]
    phases = [p for p in PHASES if any(r.phase == p for r in synthetic)]
    real_phases = sorted({r.phase for r in real}, key=PHASES.index)
    rows = []
    if len(real_phases) < 2:
        note = f"real training tumors cover {len(real_phases)} phase(s); a phase classifier needs two"
        for phase in phases:
            n = sum(r.phase == phase for r in synthetic)
            rows.append({"phase": phase, "n_synthetic": n, "accuracy": math.nan, "real_cv_accuracy": math.nan, "n_real": 0, "note": note})
        return pd.DataFrame(rows, columns=["phase", "n_synthetic", "accuracy", "real_cv_accuracy", "n_real", "note"])

    def features(group):
        return np.array([[r.stats[name] for name in PHASE_FEATURES] for r in group])

    x_real, y_real = features(real), np.array([r.phase for r in real])
    classifier = make_pipeline(StandardScaler(), LogisticRegression(max_iter=2000))
    smallest = min(int((y_real == p).sum()) for p in real_phases)
    cv_predicted = None
    if smallest >= 2:
        folds = StratifiedKFold(n_splits=min(5, smallest), shuffle=True, random_state=seed)
        cv_predicted = cross_val_predict(classifier, x_real, y_real, cv=folds)
    classifier.fit(x_real, y_real)
    for phase in phases:
        group = [r for r in synthetic if r.phase == phase]
        predicted = classifier.predict(features(group))
        in_real = y_real == phase
        row = {
            "phase": phase,
            "n_synthetic": len(group),
            "accuracy": float((predicted == phase).mean()),
            "real_cv_accuracy": float((cv_predicted[in_real] == phase).mean()) if cv_predicted is not None and in_real.any() else math.nan,
            "n_real": int(in_real.sum()),
            "note": "" if in_real.any() else "the classifier never saw a real tumor of this phase",
        }
        rows.append(row)
    return pd.DataFrame(rows, columns=["phase", "n_synthetic", "accuracy", "real_cv_accuracy", "n_real", "note"])


def diversity_table(records: Sequence[TumorRecord]) -> pd.DataFrame:
    """Mean pairwise NCC of tumor patches per condition (phase, sex, age band), synthetic and real.

    A condition needs two tumors of a kind for that kind's NCC; otherwise it is NaN with the count.
    """
    rows = []
    conditions = sorted(
        {(r.phase, r.sex, r.age_band) for r in records if r.synthetic == 1},
        key=_group_order(("phase", "sex", "age_band")),
    )
    for condition in conditions:
        row = {"phase": condition[0], "sex": condition[1], "age_band": condition[2]}
        for kind, flag in (("synthetic", 1), ("real", 0)):
            patches = [r.patch for r in records if r.synthetic == flag and (r.phase, r.sex, r.age_band) == condition]
            pairs = [normalized_cross_correlation(a, b) for a, b in itertools.combinations(patches, 2)]
            row[f"n_{kind}"] = len(patches)
            row[f"mean_ncc_{kind}"] = _nanmean(pairs)
        rows.append(row)
    return pd.DataFrame(rows, columns=["phase", "sex", "age_band", "n_synthetic", "mean_ncc_synthetic", "n_real", "mean_ncc_real"])


def realism_frame(records: Sequence[TumorRecord], copy_paste: Sequence[TumorRecord] = ()) -> pd.DataFrame:
    """One row per tumor for :func:`synthx.analysis.realism.realism_table`: ``kind`` real, synthetic or copy_paste."""
    rows = [
        {"case_id": r.case_id, "kind": kind or ("synthetic" if r.synthetic else "real"), "phase": r.phase, **r.realism}
        for group, kind in ((records, None), (copy_paste, "copy_paste"))
        for r in group
        if r.phase != UNKNOWN
    ]
    return pd.DataFrame(rows, columns=["case_id", "kind", "phase", *REALISM_FEATURES, *SURROUND])


def example_grid(records: Sequence[TumorRecord], per_kind: int = 2):
    """A figure with one row per phase: ``per_kind`` real then ``per_kind`` synthetic axial slices through tumors."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    phases = [p for p in PHASES if any(r.phase == p for r in records)]
    columns = 2 * per_kind
    figure, axes = plt.subplots(
        max(len(phases), 1), columns, figsize=(2.2 * columns, 2.2 * max(len(phases), 1)), squeeze=False
    )
    for axis in axes.ravel():
        axis.axis("off")
    for row, phase in enumerate(phases):
        for offset, (kind, flag) in enumerate((("real", 0), ("synthetic", 1))):
            chosen = [r for r in records if r.phase == phase and r.synthetic == flag][:per_kind]
            for k, record in enumerate(chosen):
                axis = axes[row, offset * per_kind + k]
                axis.imshow(record.slice_image.T, cmap="gray", vmin=DISPLAY_WINDOW[0], vmax=DISPLAY_WINDOW[1], origin="lower")
                axis.contour(record.slice_mask.T, levels=[0.5], colors="tab:red", linewidths=0.8, origin="lower")
                axis.set_title(f"{phase}\n{kind}: {record.case_id}", fontsize=7)
    if not phases:
        axes[0, 0].text(0.5, 0.5, "no tumors", ha="center", va="center")
    figure.tight_layout()
    return figure


def quality_report(
    real_root: Path | str | Cohort,
    split_path: Path | str,
    synthetic_root: Path | str | Cohort,
    lesion_class: str = "pancreatic_lesion",
    organ_class: str = "pancreas",
    rim_mm: float = 5.0,
    patch_size: int = 16,
    seed: int = 0,
    copy_paste_root: Path | str | Cohort | None = None,
    embed=None,
) -> QualityReport:
    """Measure the synthetic tumors of ``synthetic_root`` against the real training tumors of ``real_root``.

    Args:
        real_root: the real cohort (folder or loaded cohort).
        split_path: its split CSV; only ``train`` cases are the real reference.
        synthetic_root: the SynthX output cohort; its ``synthetic=1`` cases are measured.
        lesion_class / organ_class: tumor and organ mask names.
        rim_mm: rim thickness for the contrast.
        patch_size: cube edge (voxels) for the diversity NCC.
        seed: for the cross-validation folds and the bootstrap.
        copy_paste_root: optionally a cohort of copy-pasted tumors (its ``synthetic=1`` cases), a
            third set the realism table compares with the real tumors beside SynthX's.
        embed: optionally the detector's encoder (:func:`synthx.analysis.realism_encoder.encoder_embedder`): the
            realism table then adds the Frechet distance of its features (``frechet_encoder``).
    """
    real_cohort = real_root if isinstance(real_root, Cohort) else load_cohort(real_root)
    synthetic_cohort = synthetic_root if isinstance(synthetic_root, Cohort) else load_cohort(synthetic_root)
    split = load_split(split_path, real_cohort)
    train_ids = [c for c in split.loc[split["split"] == "train", "case_id"] if c in real_cohort]
    real_rows = real_cohort.subset(train_ids) if train_ids else real_cohort.metadata.iloc[0:0]
    real_ids = [c for c, s in zip(real_rows["case_id"], real_rows["synthetic"]) if int(s) == 0]
    synthetic_ids = list(synthetic_cohort.metadata.loc[synthetic_cohort.metadata["synthetic"] == 1, "case_id"])
    if not synthetic_ids:
        raise QualityError(f"cohort {synthetic_cohort.root} has no synthetic=1 case to assess")
    real = collect_tumors(real_cohort, real_ids, 0, lesion_class, organ_class, rim_mm, patch_size, embed=embed)
    synthetic = collect_tumors(synthetic_cohort, synthetic_ids, 1, lesion_class, organ_class, rim_mm, patch_size, embed=embed)
    if not synthetic:
        raise QualityError(f"cohort {synthetic_cohort.root}: no synthetic case has a {lesion_class} voxel")
    records = real + synthetic
    copy_paste = []
    if copy_paste_root is not None:
        pasted = copy_paste_root if isinstance(copy_paste_root, Cohort) else load_cohort(copy_paste_root)
        pasted_ids = list(pasted.metadata.loc[pasted.metadata["synthetic"] == 1, "case_id"])
        if not pasted_ids:
            raise QualityError(f"copy-paste cohort {pasted.root} has no synthetic=1 case to compare")
        copy_paste = collect_tumors(pasted, pasted_ids, 1, lesion_class, organ_class, rim_mm, patch_size, embed=embed)
    per_tumor = pd.DataFrame(
        [
            {
                "case_id": r.case_id,
                "synthetic": r.synthetic,
                "phase": r.phase,
                "sex": r.sex,
                "age_band": r.age_band,
                "cohort": r.cohort,
                "voxels": r.voxels,
                "rim_voxels": r.rim_voxels,
                **r.stats,
                **{name: r.realism[name] for name in (*REALISM_FEATURES, *SURROUND) if name not in r.stats},
            }
            for r in records
        ]
    )
    return QualityReport(
        per_tumor=per_tumor,
        intensity=intensity_table(records),
        faithfulness=phase_faithfulness(records, seed),
        diversity=diversity_table(records),
        realism=realism_table(realism_frame(records, copy_paste), seed=seed, embeddings=_embeddings(records, copy_paste)),
        figure=example_grid(records),
        records=records,
    )


# ----------------------------------------------------------------------------------------------


def _load_ct(case: Case) -> tuple[np.ndarray, tuple[float, float, float]]:
    if not case.ct_path.is_file():
        raise QualityError(f"case {case.case_id}: CT file {case.ct_path} is missing")
    try:
        image = nib.load(case.ct_path)
        data = np.asarray(image.dataobj, dtype=np.float32)
    except Exception as error:  # nibabel raises several types for broken files
        raise QualityError(f"case {case.case_id}: cannot read CT {case.ct_path}: {error}") from error
    if data.ndim != 3:
        raise QualityError(f"case {case.case_id}: CT {case.ct_path} has shape {data.shape}, expected 3D")
    return data, tuple(float(s) for s in image.header.get_zooms()[:3])


def _load_mask(case: Case, class_name: str, shape, required: bool) -> np.ndarray | None:
    path = case.mask_path(class_name)
    if not path.is_file():
        if required:
            raise QualityError(f"case {case.case_id}: mask {class_name} ({path}) is missing")
        return None
    mask = np.asarray(nib.load(path).dataobj) > 0
    if mask.shape != tuple(shape):
        raise QualityError(f"case {case.case_id}: mask {path} has shape {mask.shape}, its CT has {tuple(shape)}")
    return mask


def _embeddings(records: Sequence[TumorRecord], copy_paste: Sequence[TumorRecord]) -> np.ndarray | None:
    """The records' encoder features in :func:`realism_frame`'s row order, or None without a detector."""
    kept = [r.embedding for r in [*records, *copy_paste] if r.phase != UNKNOWN]
    return np.vstack(kept) if kept and all(e is not None for e in kept) else None


def _crop_slice(volume: np.ndarray, centre: Sequence[int], size: int) -> np.ndarray:
    """The axial (last-axis) slice through ``centre``, cropped to a ``size`` square around it."""
    plane = volume[:, :, int(centre[2])]
    return centred_patch(plane[..., None], (centre[0], centre[1], 0), size)[:, :, size // 2]


def _nanmean(values) -> float:
    finite = [v for v in values if v is not None and np.isfinite(v)]
    return float(np.mean(finite)) if finite else math.nan


def _wasserstein(real: list[np.ndarray], synthetic: list[np.ndarray]) -> float:
    if not real or not synthetic:
        return math.nan
    return float(wasserstein_distance(np.concatenate(real), np.concatenate(synthetic)))


def _group_order(attributes: Sequence[str]):
    orders = {"phase": PHASES, "sex": SEXES, "age_band": AGE_BAND_NAMES}

    def key(values):
        return tuple(orders[a].index(v) if v in orders[a] else len(orders[a]) for a, v in zip(attributes, values))

    return key


