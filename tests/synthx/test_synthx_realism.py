"""Realism metrics on planted tumors: a matching set is indistinguishable, each planted flaw is caught by its metric.

Run: OMP_NUM_THREADS=1 .venv/bin/pytest tests/synthx/test_synthx_realism.py -x -q
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
from scipy import ndimage

from synthx.analysis.realism import (
    FEATURES,
    bootstrap_frechet,
    bootstrap_mean_difference,
    classifier_two_sample_test,
    edge_gradient,
    feature_matrix,
    frechet_distance,
    glcm_texture,
    quality_filter,
    realism_features,
    realism_table,
    shape_features,
    shell_fat,
)

SHAPE = (28, 28, 20)
SPACING = (1.0, 1.0, 1.0)
ORGAN_HU = 100.0


def planted_tumor(rng, contrast=-40.0, noise=10.0, seam=False, offset=0.0):
    """A CT with an organ (ORGAN_HU, 5 HU noise, in fat at -100 HU) and an ellipsoidal tumor of random radii.

    The tumor's contrast fades in over about 2 voxels (a Gaussian-blurred mask) unless ``seam``,
    where it steps; its own noise has SD ``noise``. ``offset`` moves its centre along the first
    axis, towards the organ's border and across it.
    """
    ct = np.full(SHAPE, -100.0)
    organ = np.zeros(SHAPE, dtype=bool)
    organ[2:-2, 2:-2, 2:-2] = True
    grid = np.indices(SHAPE, dtype=float)
    centre = np.array(SHAPE) / 2 + rng.uniform(-1.5, 1.5, 3) + np.array([offset, 0.0, 0.0])
    radii = rng.uniform(3.5, 6.0, 3)
    tumor = (((grid - centre[:, None, None, None]) / radii[:, None, None, None]) ** 2).sum(axis=0) <= 1.0
    ct[organ] = ORGAN_HU + rng.normal(0, 5, int(organ.sum()))
    weight = tumor.astype(float) if seam else np.clip(ndimage.gaussian_filter(tumor.astype(float), 1.5) * 1.6, 0, 1)
    ct += weight * (contrast + rng.normal(0, 4.0))  # each tumor's contrast varies by about 4 HU
    ct[tumor] += rng.normal(0, noise, int(tumor.sum()))
    return ct, tumor, organ


def feature_rows(seed, n, kind, phase="arterial", **flaw):
    rng = np.random.default_rng(seed)
    rows = []
    for k in range(n):
        ct, tumor, organ = planted_tumor(rng, **flaw)
        rows.append({"case_id": f"{kind}{seed}-{k}", "kind": kind, "phase": phase, **realism_features(ct, tumor, organ, SPACING)})
    return pd.DataFrame(rows)


@pytest.fixture(scope="module")
def planted():
    """Real tumors, a set drawn from the same distribution, and four flawed sets (30 tumors each)."""
    return {
        "real": feature_rows(1, 30, "real"),
        "matching": feature_rows(2, 30, "synthetic"),
        "contrast": feature_rows(3, 30, "synthetic", contrast=-10.0),
        "noisy": feature_rows(4, 30, "synthetic", noise=20.0),
        "seam": feature_rows(5, 30, "synthetic", seam=True),
        "protruding": feature_rows(6, 30, "synthetic", offset=9.0),
    }


def _matrix(frame):
    return feature_matrix(frame.dropna(subset=list(FEATURES)))


def test_features_of_a_uniform_cube():
    ct = np.full((12, 12, 12), 100.0)
    organ = np.ones(ct.shape, dtype=bool)
    tumor = np.zeros(ct.shape, dtype=bool)
    tumor[3:9, 3:9, 3:9] = True
    ct[tumor] = 60.0
    features = realism_features(ct, tumor, organ, (1.0, 1.0, 2.0), rim_mm=2.0)
    assert features["contrast"] == -40.0 and features["tumor_sd"] == 0.0
    assert features["glcm_contrast"] == 0.0 and features["glcm_homogeneity"] == 1.0  # one grey level
    assert features["volume_ml"] == pytest.approx(6 * 6 * 6 * 2.0 / 1000)
    # A cube's voxel surface is bevelled by marching cubes: sphericity between a cube's (0.806) and 1.
    assert 0.8 < features["sphericity"] < 1.0 and features["solidity"] == pytest.approx(1.0, abs=1e-6)
    # On the shell the central difference sees half the 40 HU step per mm at the faces (20 HU/mm).
    assert 5.0 < features["edge_gradient"] <= 20.0 * math.sqrt(3)


def test_glcm_contrast_is_the_mean_squared_grey_level_step_inside_the_tumor():
    ct = np.zeros((6, 6, 1))
    ct[:, ::2, 0] = 100.0  # stripes along the second axis: horizontal neighbours alternate
    tumor = np.ones(ct.shape, dtype=bool)
    contrast, homogeneity = glcm_texture(ct, tumor, hu_window=(0.0, 100.0), levels=2)
    # Grey levels 0/1: pairs along axis 0 equal, along axis 1 and both diagonals differ by 1.
    # Counted pairs (symmetric): 0 deg 2*6*5=60 differ, 90 deg 60 equal, 45/135 deg 2*5*5=50 each differ.
    assert contrast == pytest.approx(160 / 220)
    assert homogeneity == pytest.approx(60 / 220 + 160 / 220 / 2)
    # Voxels outside the tumor never enter the matrix: a bright surround changes nothing.
    outside = np.pad(ct, ((2, 2), (2, 2), (0, 0)), constant_values=1000.0)
    assert glcm_texture(outside, np.pad(tumor, ((2, 2), (2, 2), (0, 0))), (0.0, 100.0), 2) == (contrast, homogeneity)


def test_a_sphere_is_more_spherical_and_solid_than_a_dumbbell():
    grid = np.indices((30, 20, 20), dtype=float)
    sphere = ((grid - np.array([15, 10, 10])[:, None, None, None]) ** 2).sum(0) <= 36
    left = ((grid - np.array([8, 10, 10])[:, None, None, None]) ** 2).sum(0) <= 25
    right = ((grid - np.array([22, 10, 10])[:, None, None, None]) ** 2).sum(0) <= 25
    bar = (np.abs(grid[1] - 10) <= 1) & (np.abs(grid[2] - 10) <= 1) & (grid[0] > 8) & (grid[0] < 22)
    ball, dumbbell = shape_features(sphere, (1, 1, 1)), shape_features(left | right | bar, (1, 1, 1))
    assert ball["sphericity"] > 0.9 and ball["solidity"] > 0.9  # a voxel sphere's staircase costs a few percent
    assert dumbbell["sphericity"] < ball["sphericity"] - 0.1 and dumbbell["solidity"] < 0.75


def test_a_step_edge_has_a_steeper_boundary_than_a_blurred_one():
    rng = np.random.default_rng(0)
    ct, tumor, _ = planted_tumor(rng, noise=0.0, seam=True)
    blurred, _, _ = planted_tumor(np.random.default_rng(0), noise=0.0, seam=False)
    assert edge_gradient(ct, tumor, SPACING) > 1.3 * edge_gradient(blurred, tumor, SPACING)


def test_shell_fat_is_the_share_of_the_outer_shell_in_the_adipose_range():
    ct = np.full((10, 10, 10), 40.0)
    tumor = np.zeros(ct.shape, dtype=bool)
    tumor[3:7, 3:7, 3:7] = True
    ct[tumor] = 200.0
    assert shell_fat(ct, tumor) == 0.0  # wrapped in soft tissue
    ct[7:, :, :] = -100.0  # fat beyond one face: 16 of the shell's 6 * 16 voxels
    assert shell_fat(ct, tumor) == pytest.approx(16 / 96)
    ct[7:, :, :] = -1000.0  # air is not fat
    assert shell_fat(ct, tumor) == 0.0
    # A tumor that fills the scan to its edges has no shell in it: no share to give.
    assert math.isnan(shell_fat(np.full((4, 4, 4), -100.0), np.ones((4, 4, 4), dtype=bool)))


def test_an_empty_tumor_is_refused():
    with pytest.raises(ValueError, match="empty"):
        realism_features(np.zeros((4, 4, 4)), np.zeros((4, 4, 4), bool), np.ones((4, 4, 4), bool), SPACING)


def test_a_matching_set_is_indistinguishable(planted):
    real, matching = planted["real"], planted["matching"]
    auc, low, high = classifier_two_sample_test(_matrix(real), _matrix(matching))
    assert low <= 0.5 <= high and abs(auc - 0.5) < 0.2
    for column in ("contrast", "tumor_sd", "glcm_contrast", "edge_gradient"):
        _, low, high = bootstrap_mean_difference(real[column], matching[column])
        assert low <= 0 <= high, column
    same, _, _ = bootstrap_frechet(_matrix(real), _matrix(matching))
    shifted, low, _ = bootstrap_frechet(_matrix(real), _matrix(planted["contrast"]))
    assert same < 0.2 * shifted and low > same


@pytest.mark.parametrize(("flaw", "metric", "sign"), [
    ("contrast", "contrast", +1),  # -10 HU painted where real tumors are -40 HU
    ("noisy", "tumor_sd", +1),  # doubled texture noise
    ("noisy", "glcm_contrast", +1),
    ("noisy", "glcm_homogeneity", -1),
    ("seam", "edge_gradient", +1),  # a step edge where real tumors fade in
    ("protruding", "shell_fat", +1),  # across the organ's border, into fat (compared alone, not in the vector)
])
def test_each_planted_flaw_is_caught_by_its_metric(planted, flaw, metric, sign):
    difference, low, high = bootstrap_mean_difference(planted["real"][metric], planted[flaw][metric])
    assert sign * low > 0 and sign * high > 0 and sign * difference > 0
    _, matching_low, matching_high = bootstrap_mean_difference(planted["real"][metric], planted["matching"][metric])
    assert matching_low <= 0 <= matching_high


@pytest.mark.parametrize("flaw", ["contrast", "noisy", "seam"])
def test_the_classifier_tells_each_flawed_set_from_real(planted, flaw):
    auc, low, _ = classifier_two_sample_test(_matrix(planted["real"]), _matrix(planted[flaw]))
    assert auc > 0.8 and low > 0.6


def test_frechet_distance_is_zero_for_equal_gaussians_and_the_mean_shift_squared_otherwise():
    rng = np.random.default_rng(0)
    a = rng.normal(size=(400, 3))
    assert frechet_distance(a, a) == pytest.approx(0.0, abs=1e-6)
    assert frechet_distance(a, a + [3.0, 0.0, 4.0]) == pytest.approx(25.0, abs=1e-6)


def test_realism_table_per_phase_with_a_copy_paste_set(planted):
    copy_paste = planted["seam"].assign(kind="copy_paste")
    venous = feature_rows(6, 4, "real", phase="venous")
    frame = pd.concat([planted["real"], planted["matching"], copy_paste, venous], ignore_index=True)
    embeddings = feature_matrix(frame.fillna(0.0))
    table = realism_table(frame, embeddings=embeddings).set_index(["phase", "comparison", "metric"])
    assert set(table.index.get_level_values("phase")) == {"arterial"}  # venous has no other set
    edge = table.loc[("arterial", "copy_paste", "edge_gradient")]
    assert edge["ci_low"] > 0 and edge["other"] > edge["real"]
    synthetic_auc = table.loc[("arterial", "synthetic", "classifier_auc")]
    assert synthetic_auc["ci_low"] <= 0.5 <= synthetic_auc["ci_high"]
    assert table.loc[("arterial", "copy_paste", "classifier_auc"), "value"] > 0.8
    for metric in ("frechet_radiomic", "frechet_encoder"):
        assert table.loc[("arterial", "synthetic", metric), "value"] < table.loc[("arterial", "copy_paste", metric), "value"]
        # Against what two sets of the same tumors score (the permutation level), only the seam stands out.
        assert table.loc[("arterial", "synthetic", metric), "p_value"] > 0.05
        assert table.loc[("arterial", "copy_paste", metric), "p_value"] < 0.01
        assert table.loc[("arterial", "copy_paste", metric), "value"] > 3 * table.loc[("arterial", "copy_paste", metric), "null"]
    assert synthetic_auc["null"] == 0.5 and synthetic_auc["p_value"] > 0.05
    assert table.loc[("arterial", "copy_paste", "classifier_auc"), "p_value"] < 0.01
    assert table.loc[("arterial", "synthetic", "contrast"), "n_real"] == 30


def test_too_few_tumors_give_undefined_tests_not_numbers():
    one = np.zeros((1, 3))
    assert all(math.isnan(v) for v in classifier_two_sample_test(one, np.ones((5, 3))))
    assert all(math.isnan(v) for v in bootstrap_frechet(one, np.ones((5, 3))))
    assert all(math.isnan(v) for v in bootstrap_mean_difference([], [1.0, 2.0]))


def test_quality_filter_drops_planted_bad_cases_and_keeps_good_ones(planted):
    good = planted["matching"].copy()
    # A quarter of the synthetic set has a seam: enough for the discriminator to learn it.
    bad = planted["seam"].iloc[:10].assign(case_id=lambda f: "bad-" + f["case_id"])
    frame = pd.concat([planted["real"], good, bad], ignore_index=True)
    result = quality_filter(frame, real_quantile=0.95).set_index("case_id")
    assert len(result) == len(good) + len(bad)
    assert not result.loc[bad["case_id"], "kept"].any()
    assert result.loc[good["case_id"], "kept"].mean() >= 0.8
    assert (result.loc[bad["case_id"], "score"] > result["threshold"].iloc[0]).all()


def test_quality_filter_keeps_what_it_cannot_judge():
    frame = pd.DataFrame([{"case_id": "r", "kind": "real", "phase": "delayed", **dict.fromkeys(FEATURES, 1.0)},
                          {"case_id": "s", "kind": "synthetic", "phase": "delayed", **dict.fromkeys(FEATURES, 9.0)}])
    result = quality_filter(frame)
    assert result["kept"].tolist() == [True] and math.isnan(result["score"].iloc[0])
    with pytest.raises(ValueError, match="real_quantile"):
        quality_filter(frame, real_quantile=0.0)


def test_frechet_distance_agrees_with_the_general_matrix_square_root():
    from scipy.linalg import sqrtm

    rng = np.random.default_rng(1)
    a, b = rng.normal(size=(50, 4)), rng.normal(size=(60, 4)) @ np.diag([1.0, 2.0, 0.5, 1.0]) + 0.3
    cov_a, cov_b = np.cov(a, rowvar=False), np.cov(b, rowvar=False)
    expected = np.sum((a.mean(0) - b.mean(0)) ** 2) + np.trace(cov_a + cov_b - 2 * sqrtm(cov_a @ cov_b).real)
    assert frechet_distance(a, b) == pytest.approx(expected, rel=1e-6)
    assert frechet_distance(a[:3], a[:3]) == pytest.approx(0.0, abs=1e-9)  # singular covariance: still exact


def _tiny_unet():
    import torch
    from monai.networks.nets import UNet

    torch.manual_seed(0)
    return UNet(spatial_dims=3, in_channels=1, out_channels=2, channels=(4, 8, 16), strides=(2, 2))


def test_the_bottleneck_is_the_coarsest_activation_before_the_decoder():
    import torch

    from synthx.analysis.realism_encoder import encoder_features, find_bottleneck

    network = _tiny_unet()
    layer = find_bottleneck(network, torch.zeros(1, 1, 16, 16, 16))
    shapes = []
    handle = dict(network.named_modules())[layer].register_forward_hook(lambda _m, _i, out: shapes.append(out.shape))
    network(torch.zeros(1, 1, 16, 16, 16))
    handle.remove()
    assert tuple(shapes[0][2:]) == (4, 4, 4)  # two stride-2 levels below 16^3
    features = encoder_features(network, torch.zeros(3, 1, 16, 16, 16), layer, batch_size=2)
    assert features.shape == (3, shapes[0][1])


def test_encoder_features_separate_a_shifted_set_and_not_a_matching_one():
    from types import SimpleNamespace

    from synthx.analysis.realism_encoder import encoder_embedder

    data = SimpleNamespace(normalization="window", hu_window=[-175.0, 250.0], patch_size=[16, 16, 16])
    embed = encoder_embedder(_tiny_unet(), data)

    def vectors(seed, **flaw):
        rng = np.random.default_rng(seed)
        return embed([planted_tumor(rng, **flaw)[:2] for _ in range(16)])

    real, matching, shifted = vectors(1), vectors(2), vectors(3, contrast=40.0)
    assert real.shape[0] == 16 and real.ndim == 2
    from synthx.analysis.realism import permutation_frechet

    same, _, _ = bootstrap_frechet(real, matching, resamples=50)
    different, _, _ = bootstrap_frechet(real, shifted, resamples=50)
    assert same < different
    # With more channels than tumors the plug-in distance is mostly bias: read it against the permutation level.
    (same_level, same_p), (shifted_level, shifted_p) = permutation_frechet(real, matching), permutation_frechet(real, shifted)
    assert same_p > 0.01 and shifted_p < 0.01 and different > shifted_level  # a test at the 1% level


def test_realism_summary_shows_one_row_per_phase_and_marks_differences_that_exclude_zero(planted):
    from synthx.analysis.realism import realism_summary

    frame = pd.concat([planted["real"], planted["seam"]], ignore_index=True)
    table = realism_table(frame)
    summary = realism_summary(table)
    assert summary["Phase"].tolist() == ["arterial"]
    row = summary.iloc[0]
    assert row["Tumors real / synthetic"] == "30 / 30"
    edge = table.set_index("metric").loc["edge_gradient"]
    assert row["Edge gradient (HU/mm)"].startswith(f"{edge['real']:.1f} / {edge['other']:.1f} [")
    assert row["Edge gradient (HU/mm)"].endswith("]*")  # the seam's steeper edge: interval above 0
    auc = table.set_index("metric").loc["classifier_auc"]
    assert row["Real vs synthetic AUC"] == (f"{auc['value']:.2f} [{auc['ci_low']:.2f}, {auc['ci_high']:.2f}] "
                                            f"(same-tumor level 0.50, p {auc['p_value']:.3f})")
    assert "Frechet (detector encoder)" not in summary.columns  # no detector given
    assert realism_summary(table, "copy_paste").empty


def test_one_voxel_and_one_voxel_thick_tumors_have_a_defined_shape():
    single = np.zeros((5, 5, 5), dtype=bool)
    single[2, 2, 2] = True
    sheet = np.zeros((9, 9, 5), dtype=bool)
    sheet[1:8, 1:8, 2] = True
    for tumor in (single, sheet):
        shape = shape_features(tumor, (1.0, 1.0, 2.0))
        assert 0.0 < shape["sphericity"] <= 1.0 and 0.0 < shape["solidity"] <= 1.0 + 1e-9


def test_the_realism_table_compares_the_fat_around_tumors_outside_the_radiomic_vector(planted):
    frame = pd.concat([planted["real"], planted["protruding"]], ignore_index=True)
    table = realism_table(frame).set_index("metric")
    assert table.loc["shell_fat", "ci_low"] > 0 and table.loc["shell_fat", "real"] < table.loc["shell_fat", "other"]
    # The classifier's vector is FEATURES alone: the same AUC with the column dropped from the frame.
    without = realism_table(frame.drop(columns=["shell_fat"])).set_index("metric")
    assert "shell_fat" not in without.index
    assert table.loc["classifier_auc", "value"] == without.loc["classifier_auc", "value"]
