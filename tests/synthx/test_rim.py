"""The parenchymal rim grown around a painted or pasted mass (``mask_prior.rim_mm``)."""

from __future__ import annotations

import nibabel as nib
import numpy as np
import pytest
from scipy import ndimage

from lightning_modules.data.cohort import CT_FILE
from synthx.generation import CopyPastePainter, PaintSettings
from synthx.generation.painting import grow_rim
from tests.synthx.test_copy_paste import PRIOR, _paint, _setup, cohort  # noqa: F401 (the fixture)

SPACING = np.array([1.0, 1.0, 1.0])
FAT, GLAND, VESSEL, TUMOR = -100.0, 130.0, 250.0, 60.0


def _scene(noise: float = 5.0):
    """A gland block in fat, an enhancing vessel along one face, and a tumor at the gland's edge that
    reaches into the fat (as a pasted tumor may) and touches the vessel."""
    rng = np.random.default_rng(0)
    shape = (40, 40, 30)
    ct = FAT + rng.normal(0, noise, shape)
    gland = np.zeros(shape, dtype=bool)
    gland[10:30, 12:28, 8:22] = True
    vessel = np.zeros(shape, dtype=bool)
    vessel[10:30, 28:32, 8:22] = True
    ct[gland] = GLAND + rng.normal(0, noise, int(gland.sum()))
    ct[vessel] = VESSEL + rng.normal(0, noise, int(vessel.sum()))
    tumor = np.zeros(shape, dtype=bool)
    tumor[16:24, 4:16, 11:19] = True  # 8 of its 12 rows in y lie in the fat beside the gland
    tumor[16:24, 24:28, 11:19] = True  # and a lobe that reaches the vessel
    tumor = ndimage.binary_closing(tumor)
    painted = ct.copy()
    painted[tumor] = TUMOR
    return ct, painted, gland, vessel, tumor


def test_no_rim_leaves_the_case_unchanged():
    canvas, painted, gland, _, tumor = _scene()
    grown, rim = grow_rim(painted, canvas, gland, tumor, SPACING, 0.0)
    assert np.array_equal(grown, painted) and not rim.any()


def test_the_rim_is_parenchyma_within_its_reach_of_the_tumor_where_the_tumor_meets_fat():
    canvas, painted, gland, vessel, tumor = _scene()
    grown, rim = grow_rim(painted, canvas, gland, tumor, SPACING, 3.0)
    distance = ndimage.distance_transform_edt(~tumor, sampling=SPACING)
    fat_near = (distance <= 3.0) & ~gland & ~tumor & ~vessel
    # Exactly the fat within 3 mm of the tumor: never the gland, the tumor or the enhancing vessel.
    assert rim.any() and np.array_equal(rim, fat_near)
    # Parenchyma's HU (the gland's local median) with the canvas' own fine noise, not a flat fill.
    assert abs(float(np.mean(grown[rim])) - GLAND) < 3.0
    assert 1.0 < float(np.std(grown[rim])) < 10.0
    # The tumor, the gland and the vessel keep their voxels; so does everything beyond the blended edge.
    kept = tumor | gland | vessel | (distance > 3.0 + 2.0)
    assert np.array_equal(grown[kept], painted[kept])
    # The outer edge is blended over about a voxel: the fat just outside the rim lies between fat and gland.
    edge = ndimage.binary_dilation(rim) & ~rim & ~gland & ~tumor & ~vessel
    changed = edge & (grown != painted)
    assert changed.any() and float(np.max(grown[changed])) < GLAND


def test_copy_paste_with_a_rim_keeps_its_tumor_and_grows_the_gland_around_it(cohort):  # noqa: F811
    real, split, canvases, plain = _setup(cohort, scale_to_site=False)
    with_rim = CopyPastePainter(real, split, PaintSettings(seed=PRIOR.seed, size_classes=dict(PRIOR.size_classes),
                                                           erosion_mm=PRIOR.erosion_mm, rim_mm=5.0), scale_to_site=False)
    hard, _ = _paint(plain, canvases, "H1")
    grown, _ = _paint(with_rim, canvases, "H1")
    lesion = grown.masks["pancreatic_lesion"].astype(bool)
    assert np.array_equal(lesion, hard.masks["pancreatic_lesion"].astype(bool))
    assert np.array_equal(grown.ct[lesion], hard.ct[lesion]), "the pasted tumor's HU are still its source's"
    canvas_ct = np.asarray(nib.load(real.root / "H1" / CT_FILE).dataobj)
    canvas_gland = np.asarray(nib.load(real.case("H1").mask_path("pancreas")).dataobj) > 0
    rim = grown.masks["pancreas"].astype(bool) & ~hard.masks["pancreas"].astype(bool)
    # The fixture's canvas is fat (-100 HU) around a venous gland (105 HU): the rim is gland-like.
    assert rim.any() and not (rim & (canvas_gland | lesion)).any()
    assert abs(float(np.mean(grown.ct[rim])) - float(np.median(canvas_ct[canvas_gland]))) < 15.0
    assert float(np.mean(canvas_ct[rim])) < -50.0, "the rim was fat in the canvas"
    assert grown.row == hard.row


def test_a_negative_rim_is_refused_naming_the_key():
    from synthx.config import RecipeError, load_synthx_recipe
    from tests.synthx.test_synthx_config import RECIPE

    assert load_synthx_recipe(RECIPE, ["profile=cpu"]).mask_prior.rim_mm == 0.0
    assert load_synthx_recipe(RECIPE, ["profile=cpu", "mask_prior.rim_mm=5"]).mask_prior.rim_mm == 5.0
    with pytest.raises(RecipeError, match=r"mask_prior.rim_mm must be >= 0 \(0: no rim\), got -1"):
        load_synthx_recipe(RECIPE, ["profile=cpu", "mask_prior.rim_mm=-1"])
