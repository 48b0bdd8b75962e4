"""The project's nnU-Net planner (lightning_modules/models/planning.py) against nnU-Net's own planners
(nnunetv2's ExperimentPlanner and nnUNetPlannerResEncM/L/XL) on two dataset fingerprints, and the
ResEnc presets' parameter counts against the networks nnU-Net builds from its plans.

nnunetv2 is installed by .ci/setup (without its dependencies: it would replace the CPU torch).
Run: ``OMP_NUM_THREADS=1 .venv/bin/pytest tests/models/test_planning_nnunet.py -q``
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from lightning_modules.models.backbones.nnunet import build_nnunet, build_resenc
from lightning_modules.models.planning import plan_nnunet, target_spacing

PLANNERS = {  # nnU-Net's planner class -> (the project's architecture name, GPU memory target)
    "ExperimentPlanner": ("plain", 8.0),
    "nnUNetPlannerResEncM": ("resenc_m", 8.0),
    "nnUNetPlannerResEncL": ("resenc_l", 24.0),
    "nnUNetPlannerResEncXL": ("resenc_xl", 40.0),
}


def _fingerprints() -> dict[str, tuple[list, list]]:
    rng = np.random.default_rng(0)
    # Portal-venous abdominal CT: thin in-plane, 0.8-1.5 mm slices, 512 x 512 x 150-400.
    thin = ([[float(rng.uniform(0.6, 0.9))] * 2 + [float(rng.choice([0.8, 1.0, 1.25, 1.5]))] for _ in range(20)],
            [[512, 512, int(rng.integers(150, 400))] for _ in range(20)])
    # Thick-slice CT (5 mm, 40-80 slices) with a few thin-slice scans: the anisotropic rules.
    thick = ([[float(rng.uniform(0.6, 0.9))] * 2 + [float(rng.choice([5.0, 5.0, 5.0, 2.5]))] for _ in range(24)],
             [[512, 512, int(rng.integers(40, 80))] for _ in range(24)])
    return {"thin": thin, "thick": thick}


@pytest.fixture(scope="module")
def nnunet_plans(tmp_path_factory):
    """nnU-Net's 3d_fullres plans per fingerprint and planner, planned in a temporary nnU-Net tree."""
    planners = pytest.importorskip("nnunetv2.experiment_planning.experiment_planners.default_experiment_planner")
    import nnunetv2.paths as paths
    import nnunetv2.utilities.dataset_name_id_conversion as conversion
    from nnunetv2.experiment_planning.experiment_planners.residual_unets import residual_encoder_unet_planners as resenc
    from nnunetv2.preprocessing.resampling.default_resampling import compute_new_shape

    root = tmp_path_factory.mktemp("nnunet")
    folders = {"nnUNet_raw": root / "raw", "nnUNet_preprocessed": root / "preprocessed", "nnUNet_results": root / "results"}
    saved = {(m, k): getattr(m, k) for m in (paths, conversion, planners) for k in folders if hasattr(m, k)}
    for module, key in saved:
        setattr(module, key, str(folders[key]))
    plans = {}
    try:
        for number, (name, (spacings, shapes)) in enumerate(_fingerprints().items()):
            dataset = f"Dataset{950 + number:03d}_{name}"
            (folders["nnUNet_raw"] / dataset / "imagesTr").mkdir(parents=True)
            (folders["nnUNet_preprocessed"] / dataset).mkdir(parents=True)
            (folders["nnUNet_raw"] / dataset / "dataset.json").write_text(json.dumps({
                "channel_names": {"0": "CT"}, "labels": {"background": 0, "pancreas": 1, "pancreatic_lesion": 2},
                "numTraining": len(shapes), "file_ending": ".nii.gz"}))
            intensities = {"mean": 100.0, "median": 100.0, "std": 50.0, "min": -1000.0, "max": 2000.0,
                           "percentile_99_5": 300.0, "percentile_00_5": -100.0}
            (folders["nnUNet_preprocessed"] / dataset / "dataset_fingerprint.json").write_text(json.dumps({
                "spacings": spacings, "shapes_after_crop": shapes, "median_relative_size_after_cropping": 1.0,
                "foreground_intensity_properties_per_channel": {"0": intensities}}))
            for planner_name in PLANNERS:
                cls = getattr(planners, planner_name, None) or getattr(resenc, planner_name)
                # No transposition: the project plans in the datamodule's axis order.
                planner = cls(dataset, suppress_transpose=True)
                # plan_experiment's 3d_fullres steps (its 2d and low-resolution plans are not compared).
                spacing = planner.determine_fullres_target_spacing()
                median = np.median([compute_new_shape(j, i, spacing) for i, j in zip(spacings, shapes)], 0)
                # The planner builds candidate networks only to count their feature maps: on the meta
                # device no weights are allocated or initialised (the plans are the same; 84 s -> 8 s).
                with torch.device("meta"):
                    plans[name, planner_name] = planner.get_plans_for_configuration(
                        spacing, median, planner.generate_data_identifier("3d_fullres"),
                        float(np.prod(median, dtype=np.float64) * len(shapes)), {})
    finally:
        for (module, key), value in saved.items():
            setattr(module, key, value)
    return plans


@pytest.mark.parametrize("fingerprint", ["thin", "thick"])
@pytest.mark.parametrize("planner_name", list(PLANNERS))
def test_planner_matches_nnunets_own(nnunet_plans, fingerprint, planner_name):
    theirs = nnunet_plans[fingerprint, planner_name]
    spacings, shapes = (np.asarray(a, dtype=float) for a in _fingerprints()[fingerprint])
    spacing = target_spacing(spacings, shapes)
    np.testing.assert_allclose(spacing, theirs["spacing"], rtol=1e-9)
    architecture, memory = PLANNERS[planner_name]
    ours = plan_nnunet(spacing, np.median(shapes * spacings / np.asarray(spacing), axis=0),
                       architecture=architecture, gpu_memory_gb=memory)
    arch = theirs["architecture"]["arch_kwargs"]
    assert ours["patch_size"] == [int(p) for p in theirs["patch_size"]]
    assert ours["n_stages"] == arch["n_stages"]
    assert ours["strides"] == [list(s) for s in arch["strides"]]
    assert ours["kernel_sizes"] == [list(k) for k in arch["kernel_sizes"]]
    assert ours["features_per_stage"] == list(arch["features_per_stage"])
    assert theirs["normalization_schemes"] == ["CTNormalization"]


@pytest.mark.parametrize("planner_name", ["nnUNetPlannerResEncM", "nnUNetPlannerResEncL", "nnUNetPlannerResEncXL"])
def test_resenc_preset_parameter_counts_match_nnunets_networks(nnunet_plans, planner_name):
    """The network nnU-Net builds from its plan and this project's build_resenc from its own plan."""
    from nnunetv2.utilities.get_network_from_plans import get_network_from_plans

    theirs = nnunet_plans["thin", planner_name]["architecture"]
    with torch.device("meta"):
        network = get_network_from_plans(theirs["network_class_name"], theirs["arch_kwargs"],
                                         theirs["_kw_requires_import"], 1, 3, allow_init=False, deep_supervision=True)
    expected = sum(p.numel() for p in network.parameters())
    spacings, shapes = (np.asarray(a, dtype=float) for a in _fingerprints()["thin"])
    spacing = target_spacing(spacings, shapes)
    architecture, memory = PLANNERS[planner_name]
    plan = plan_nnunet(spacing, np.median(shapes * spacings / np.asarray(spacing), axis=0),
                       architecture=architecture, gpu_memory_gb=memory)
    with torch.device("meta"):
        ours = build_resenc(3, 1, 3, patch_size=plan["patch_size"], n_stages=plan["n_stages"], strides=plan["strides"],
                            kernel_sizes=plan["kernel_sizes"], features_per_stage=plan["features_per_stage"])
    assert sum(p.numel() for p in ours.parameters()) == expected


def test_plain_network_parameter_count_matches_nnunets(nnunet_plans):
    from nnunetv2.utilities.get_network_from_plans import get_network_from_plans

    theirs = nnunet_plans["thin", "ExperimentPlanner"]["architecture"]
    arch = theirs["arch_kwargs"]
    with torch.device("meta"):
        network = get_network_from_plans(theirs["network_class_name"], arch, theirs["_kw_requires_import"], 1, 3,
                                         allow_init=False, deep_supervision=True)
        ours = build_nnunet(3, 1, 3, patch_size=(320, 320, 320), n_stages=arch["n_stages"], strides=arch["strides"],
                            kernel_sizes=arch["kernel_sizes"], features_per_stage=arch["features_per_stage"])
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in network.parameters())
