"""SynthX quality statistics on hand-made volumes with known HU, and the report end to end (MLflow, CLI).

Run: OMP_NUM_THREADS=1 .venv/bin/pytest tests/test_synthx_quality.py -x -q
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from lightning_modules.data.cohort import load_cohort, write_case, write_metadata
from synthx.commands.synthx_quality import log_quality, main
from synthx.config import RecipeError, load_synthx_recipe
from synthx.analysis.quality import (
    centred_patch,
    intensity_table,
    normalized_cross_correlation,
    quality_report,
    tumor_statistics,
)

SHAPE = (20, 20, 12)
SPACING = (2.0, 2.0, 3.0)
# (organ HU, tumor HU) per phase: hypo-attenuating tumors, least contrast on non-contrast (docs/explanation/data.md "The phantom cohort").
PHASE_HU = {"non-contrast": (45.0, 40.0), "arterial": (130.0, 65.0), "venous": (105.0, 90.0)}


def test_contrast_of_a_50_hu_tumor_in_a_100_hu_organ_is_minus_50():
    ct = np.full(SHAPE, -100.0)
    organ = np.zeros(SHAPE, dtype=bool)
    organ[4:16, 4:16, 2:10] = True
    ct[organ] = 100.0
    tumor = np.zeros(SHAPE, dtype=bool)
    tumor[8:12, 8:12, 5:7] = True
    ct[tumor] = 50.0
    stats, quantiles, rim_voxels = tumor_statistics(ct, tumor, organ, SPACING, rim_mm=4.0)
    assert stats["tumor_mean"] == 50.0 and stats["tumor_sd"] == 0.0
    assert stats["tumor_p5"] == stats["tumor_p95"] == 50.0
    assert stats["rim_mean"] == 100.0  # the -100 HU outside the organ never enters the rim
    assert stats["contrast"] == -50.0
    assert np.all(quantiles == 50.0)
    assert rim_voxels > 0


def test_rim_is_spacing_aware_and_stays_inside_the_organ():
    ct = np.zeros((9, 9, 9))
    organ = np.ones_like(ct, dtype=bool)
    tumor = np.zeros_like(organ)
    tumor[4, 4, 4] = True
    # 2 mm rim with 1x1x3 mm voxels: in-plane offsets within 2 mm (4 at 1, 4 at 1.41, 4 at 2), none along z.
    _, _, rim_voxels = tumor_statistics(ct, tumor, organ, (1.0, 1.0, 3.0), rim_mm=2.0)
    assert rim_voxels == 12
    organ[:, :4, :] = False  # cut away half the plane: the rim keeps only organ voxels
    _, _, rim_voxels = tumor_statistics(ct, tumor, organ, (1.0, 1.0, 3.0), rim_mm=2.0)
    assert rim_voxels == 12 - 4  # the offsets with negative y: (0,-1), (-1,-1), (1,-1), (0,-2)


def test_empty_rim_gives_undefined_contrast_not_zero():
    ct = np.full((6, 6, 6), 30.0)
    tumor = np.zeros((6, 6, 6), dtype=bool)
    tumor[2:4, 2:4, 2:4] = True
    stats, _, rim_voxels = tumor_statistics(ct, tumor, tumor, (1.0, 1.0, 1.0), rim_mm=2.0)
    assert rim_voxels == 0 and math.isnan(stats["contrast"])


def test_ncc_and_centred_patch():
    rng = np.random.default_rng(0)
    a = rng.normal(size=(8, 8, 8))
    assert normalized_cross_correlation(a, a) == pytest.approx(1.0)
    assert normalized_cross_correlation(a, -3 * a + 7) == pytest.approx(-1.0)
    assert math.isnan(normalized_cross_correlation(a, np.ones_like(a)))
    volume = np.arange(10 * 10 * 10, dtype=float).reshape(10, 10, 10)
    patch = centred_patch(volume, (5, 5, 5), 4)
    assert patch.shape == (4, 4, 4)
    assert patch[2, 2, 2] == volume[5, 5, 5]
    corner = centred_patch(volume, (0, 0, 0), 4)  # edge-padded outside the volume
    assert corner.shape == (4, 4, 4) and corner[0, 0, 0] == volume[0, 0, 0]


def _write_cohort(root, cases, synthetic):
    """cases: (case_id, phase, sex, age, tumor HU offset, noise seed, tumor position)."""
    root.mkdir(parents=True)
    rows = []
    affine = np.diag(list(SPACING) + [1.0])
    for case_id, phase, sex, age, offset, seed, position in cases:
        rng = np.random.default_rng(seed)
        organ_hu, tumor_hu = PHASE_HU[phase]
        ct = np.full(SHAPE, -100.0) + rng.normal(0, 5, SHAPE)
        organ = np.zeros(SHAPE, dtype=bool)
        organ[3:17, 3:17, 2:10] = True
        ct[organ] = organ_hu + rng.normal(0, 5, int(organ.sum()))
        tumor = np.zeros(SHAPE, dtype=bool)
        x, y = position
        tumor[x : x + 3, y : y + 3, 5:7] = True
        ct[tumor] = tumor_hu + offset + rng.normal(0, 5, int(tumor.sum()))
        write_case(root, case_id, np.round(ct), affine, {"pancreas": organ, "pancreatic_lesion": tumor})
        rows.append(
            {
                "case_id": case_id,
                "patient_id": f"P-{case_id}",
                "sex": sex,
                "age": age,
                "phase": phase,
                "tumor": 1,
                "synthetic": synthetic,
                "source_case_id": f"CANVAS-{case_id}" if synthetic else "",
            }
        )
    write_metadata(root, pd.DataFrame(rows))


@pytest.fixture
def cohorts(tmp_path):
    real_cases = [
        (f"R{phase[:3]}{k}", phase, "F" if k % 2 else "M", 55 + k, 0.0, 100 * i + k, (6 + k, 7))
        for i, phase in enumerate(PHASE_HU)
        for k in range(4)
    ]
    synthetic_cases = [
        (f"S{phase[:3]}{k}", phase, "F", 70, 2.0, 1000 + 100 * i + k, (7, 6 + k))
        for i, phase in enumerate(("arterial", "venous"))
        for k in range(3)
    ]
    _write_cohort(tmp_path / "real", real_cases, 0)
    _write_cohort(tmp_path / "synthetic", synthetic_cases, 1)
    split = tmp_path / "split.csv"
    # One venous case is in the test split: the reference is the training split only.
    rows = [
        {"case_id": c[0], "patient_id": f"P-{c[0]}", "split": "test" if c[0] == "Rven3" else "train"} for c in real_cases
    ]
    pd.DataFrame(rows).to_csv(split, index=False)
    return tmp_path / "real", split, tmp_path / "synthetic"


def test_report_compares_real_and_synthetic_per_phase(cohorts):
    real, split, synthetic = cohorts
    report = quality_report(real, split, synthetic, rim_mm=4.0)
    # 12 real tumors minus the venous test case, 6 synthetic ones.
    assert (report.per_tumor["synthetic"] == 0).sum() == 11
    assert (report.per_tumor["synthetic"] == 1).sum() == 6
    table = report.intensity.set_index(["attribute", "group"])
    for phase, (organ_hu, tumor_hu) in PHASE_HU.items():
        row = table.loc[("phase", phase)]
        assert row["contrast_real"] == pytest.approx(tumor_hu - organ_hu, abs=4.0)
        assert row["n_real"] == (3 if phase == "venous" else 4)
    assert table.loc[("phase", "non-contrast"), "n_synthetic"] == 0
    assert math.isnan(table.loc[("phase", "non-contrast"), "wasserstein_hu"])  # undefined, not 0
    # The synthetic tumors are 2 HU brighter: the distance between HU distributions is about 2.
    assert table.loc[("phase", "arterial"), "wasserstein_hu"] == pytest.approx(2.0, abs=1.5)
    assert table.loc[("overall", "all"), "n_synthetic"] == 6
    assert ("phase:sex", "arterial:F") in table.index
    # Phases are far apart in tumor HU: a classifier trained on real tumors gets the synthetic ones right.
    faithfulness = report.faithfulness.set_index("phase")
    assert list(faithfulness.index) == ["arterial", "venous"]
    assert faithfulness.loc["arterial", "accuracy"] == 1.0 and faithfulness.loc["venous", "accuracy"] == 1.0
    assert faithfulness.loc["arterial", "real_cv_accuracy"] == 1.0
    diversity = report.diversity.set_index(["phase", "sex", "age_band"])
    assert diversity.loc[("arterial", "F", "60-80"), "n_synthetic"] == 3
    assert -1.0 <= diversity.loc[("arterial", "F", "60-80"), "mean_ncc_synthetic"] <= 1.0
    assert math.isnan(diversity.loc[("arterial", "F", "60-80"), "mean_ncc_real"])  # no real F/60-80 arterial pair
    assert len(report.figure.axes) == 3 * 4
    # Realism per phase with synthetic tumors: every feature, the classifier test and the distance.
    realism = report.realism.set_index(["phase", "comparison", "metric"])
    assert set(realism.index.get_level_values("phase")) == {"arterial", "venous"}
    contrast = realism.loc[("arterial", "synthetic", "contrast")]
    assert contrast["n_real"] == 4 and contrast["n_other"] == 3
    assert contrast["value"] == pytest.approx(contrast["other"] - contrast["real"])
    assert contrast["value"] == pytest.approx(2.0, abs=3.0)  # the synthetic tumors are 2 HU brighter
    assert contrast["ci_low"] <= contrast["value"] <= contrast["ci_high"]
    auc = realism.loc[("venous", "synthetic", "classifier_auc")]
    assert 0.0 <= auc["ci_low"] <= auc["value"] <= auc["ci_high"] <= 1.0
    assert realism.loc[("arterial", "synthetic", "frechet_radiomic"), "value"] >= 0.0
    assert {"glcm_contrast", "edge_gradient", "sphericity", "solidity"} <= set(report.per_tumor.columns)


def test_identical_tumors_have_zero_wasserstein_distance(cohorts):
    real, split, _ = cohorts
    cohort = load_cohort(real)
    from synthx.analysis.quality import collect_tumors

    records = collect_tumors(cohort, ["Rart0", "Rart1"], 0) + collect_tumors(cohort, ["Rart0", "Rart1"], 1)
    row = intensity_table(records).set_index(["attribute", "group"]).loc[("phase", "arterial")]
    assert row["wasserstein_hu"] == 0.0 and row["wasserstein_contrast"] == 0.0
    assert row["contrast_real"] == row["contrast_synthetic"]


def test_report_is_logged_to_mlflow_and_cli_runs(cohorts, mlflow_uri, tmp_path):
    import mlflow

    real, split, synthetic = cohorts
    report = quality_report(real, split, synthetic)
    with mlflow.start_run() as run:
        log_quality(report, run.info.run_id)
    logged = mlflow.get_run(run.info.run_id).data.metrics
    assert logged["synthx_quality/phase_accuracy/phase/venous"] == 1.0
    assert "synthx_quality/contrast_real/phase/non-contrast" in logged
    assert "synthx_quality/contrast_synthetic/phase/non-contrast" not in logged  # undefined stays out
    arterial = report.intensity.set_index(["attribute", "group"]).loc[("phase", "arterial")]
    for side in ("real", "synthetic"):  # texture beside contrast
        assert logged[f"synthx_quality/tumor_sd_{side}/phase/arterial"] == pytest.approx(arterial[f"tumor_sd_{side}"])
        assert arterial[f"tumor_sd_{side}"] == pytest.approx(5.0, abs=2.0)  # the fixture's 5 HU noise
    realism = report.realism.set_index(["phase", "comparison", "metric"])
    for suffix, column in (("", "value"), ("_ci_low", "ci_low"), ("_ci_high", "ci_high")):
        key = f"synthx_quality/realism/synthetic/classifier_auc{suffix}/arterial"
        assert logged[key] == pytest.approx(realism.loc[("arterial", "synthetic", "classifier_auc"), column])
    assert "synthx_quality/realism/synthetic/edge_gradient/venous" in logged
    artifacts = {a.path for a in mlflow.MlflowClient().list_artifacts(run.info.run_id, "synthx_quality")}
    assert "synthx_quality/examples.png" in artifacts and "synthx_quality/intensity.csv" in artifacts
    assert "synthx_quality/realism.csv" in artifacts

    out = tmp_path / "report"
    argv = ["--root", str(real), "--split", str(split), "--synthetic", str(synthetic), "--tracking-uri", mlflow_uri]
    code = main(argv + ["--out", str(out)])
    assert code == 0
    assert (out / "examples.png").stat().st_size > 0
    assert pd.read_csv(out / "faithfulness.csv")["accuracy"].tolist() == [1.0, 1.0]


def test_a_copy_paste_cohort_without_synthetic_cases_is_refused_by_name(cohorts):
    from synthx.analysis.quality import QualityError

    real, split, synthetic = cohorts
    with pytest.raises(QualityError, match=f"copy-paste cohort {real}.*no synthetic=1 case"):
        quality_report(real, split, synthetic, copy_paste_root=real)


def test_missing_organ_mask_names_the_case(cohorts):
    real, split, synthetic = cohorts
    (synthetic / "Sart0" / "segmentations" / "pancreas.nii.gz").unlink()
    with pytest.raises(ValueError, match="Sart0.*pancreas"):
        quality_report(real, split, synthetic)


def test_cli_applies_the_recipes_quality_filter_and_compares_a_copy_paste_cohort(cohorts, mlflow_uri, tmp_path):
    import mlflow

    from conftest import RECIPES

    real, split, synthetic = cohorts
    out = tmp_path / "report"
    argv = ["--root", str(real), "--split", str(split), "--synthetic", str(synthetic), "--tracking-uri", mlflow_uri,
            "--out", str(out), "--copy-paste", str(synthetic), "--recipe", str(RECIPES / "generator" / "synthx.yaml"),
            "quality_filter.enabled=true", "quality_filter.folds=2"]
    assert main(argv) == 0
    decisions = pd.read_csv(out / "quality_filter.csv")
    assert sorted(decisions["case_id"]) == sorted(f"S{p[:3]}{k}" for p in ("arterial", "venous") for k in range(3))
    assert set(decisions.columns) == {"case_id", "phase", "score", "threshold", "kept"}
    assert (decisions["kept"] == (decisions["score"] <= decisions["threshold"])).all()
    realism = pd.read_csv(out / "realism.csv")
    assert set(realism["comparison"]) == {"synthetic", "copy_paste"}
    run = mlflow.search_runs(experiment_names=["synthx"], output_format="list")[0]
    assert run.info.status == "FINISHED"
    assert "synthx_quality/quality_filter/dropped/arterial" in run.data.metrics
    paths = {a.path for a in mlflow.MlflowClient().list_artifacts(run.info.run_id, "synthx_quality")}
    assert "synthx_quality/quality_filter.csv" in paths


def test_quality_filter_is_off_by_default_checked_and_not_part_of_the_generator_key():
    from conftest import RECIPES
    from synthx.training.run import recipe_key

    path = RECIPES / "generator" / "synthx.yaml"
    recipe = load_synthx_recipe(path)
    assert recipe.quality_filter.enabled is False
    assert recipe_key(load_synthx_recipe(path, ["quality_filter.enabled=true"])) == recipe_key(recipe)
    for override in ("quality_filter.real_quantile=1.5", "quality_filter.folds=1"):
        with pytest.raises(RecipeError, match="quality_filter"):
            load_synthx_recipe(path, [override])


def test_recipe_overrides_without_a_recipe_are_refused(cohorts):
    real, split, synthetic = cohorts
    with pytest.raises(RecipeError, match="need --recipe"):
        main(["--root", str(real), "--split", str(split), "--synthetic", str(synthetic), "quality_filter.enabled=true"])


def test_cli_with_a_detector_checkpoint_adds_the_encoder_frechet_distance(cohorts, mlflow_uri, tmp_path):
    import torch

    from conftest import RECIPES
    from lightning_modules.models.checkpoints import build_module
    from lightning_modules.recipe import load_recipe, recipe_to_yaml

    recipe = load_recipe(RECIPES / "unet.yaml", ["profile=cpu"])
    (tmp_path / "detector.yaml").write_text(recipe_to_yaml(recipe))
    torch.save({"state_dict": build_module(recipe).state_dict()}, tmp_path / "detector.ckpt")
    real, split, synthetic = cohorts
    out = tmp_path / "report"
    assert main(["--root", str(real), "--split", str(split), "--synthetic", str(synthetic), "--tracking-uri", mlflow_uri,
                 "--out", str(out), "--detector-checkpoint", str(tmp_path / "detector.ckpt"),
                 "--detector-recipe", str(tmp_path / "detector.yaml")]) == 0
    realism = pd.read_csv(out / "realism.csv").set_index(["phase", "comparison", "metric"])
    for phase in ("arterial", "venous"):
        row = realism.loc[(phase, "synthetic", "frechet_encoder")]
        assert row["value"] >= 0.0 and row["ci_low"] <= row["ci_high"] and row["n_other"] == 3
