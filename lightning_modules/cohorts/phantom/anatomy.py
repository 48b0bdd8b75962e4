"""The phantom's anatomy: a label map of tissues in reference-mm coordinates, built per patient.

Shapes are smooth ellipsoids and tubes; organ sizes follow age and sex (:func:`organ_size_factors`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
from scipy.interpolate import CubicSpline
from scipy.spatial.transform import Rotation

from lightning_modules.data.cohort import ORGAN_CLASSES
from lightning_modules.cohorts.phantom.plan import LESION_CLASSES, ScanPlan, geometry_scale
from lightning_modules.cohorts.phantom.tissues import (
    _ON_CAVITY,
    _ON_FAT,
    _ON_LIVER_OR_CAVITY,
    _ON_POSTERIOR_WALL,
    _ON_SOFT_ORGANS,
    MASK_TISSUES,
    N_TISSUES,
    Tissue,
    _allowed,
)

# ----------------------------------------------------------------------------------------------
# Rendering: a label map of tissues in reference-mm coordinates, then intensities.


class _Grid:
    """Voxel-centre coordinates of the volume in reference mm (world mm divided by the scale).

    World coordinates follow NIfTI RAS+: the first axis increases toward the patient's Right, the
    second toward Anterior, the third toward Superior; the volume centre is at the origin.
    """

    def __init__(self, shape: Sequence[int], spacing: Sequence[float], placement_mm: Sequence[float] = (0.0, 0.0, 0.0)):
        """``placement_mm``: where the anatomy's reference origin lies in the volume (reference mm from
        the volume centre): the patient's position on the table and the scan range."""
        self.shape = tuple(int(n) for n in shape)
        self.spacing = np.asarray(spacing, dtype=float)
        self.scale = geometry_scale(shape, spacing)
        origin = -(np.asarray(self.shape) - 1) / 2.0 * self.spacing
        self.affine = np.diag([*self.spacing, 1.0])
        self.affine[:3, 3] = origin
        self.axes = [
            ((origin[i] + np.arange(n) * self.spacing[i]) / self.scale - placement_mm[i]).astype(np.float32)
            for i, n in enumerate(self.shape)
        ]

    def box(self, center: Sequence[float], half_extent: Sequence[float]) -> tuple[slice, slice, slice] | None:
        """Index slices covering an axis-aligned box (reference mm), or None when it misses the volume."""
        slices = []
        for axis, c, h in zip(self.axes, center, half_extent):
            start = int(np.searchsorted(axis, c - h, side="left"))
            stop = int(np.searchsorted(axis, c + h, side="right"))
            if start >= stop:
                return None
            slices.append(slice(start, stop))
        return tuple(slices)

    def local(self, box: tuple[slice, slice, slice]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Broadcastable coordinate arrays of a box."""
        x, y, z = (axis[s] for axis, s in zip(self.axes, box))
        return x[:, None, None], y[None, :, None], z[None, None, :]


def _ellipsoid(
    grid: _Grid, center: Sequence[float], semi_axes: Sequence[float], rotation: np.ndarray | None = None
) -> tuple[tuple[slice, slice, slice], np.ndarray] | None:
    """The voxels inside an ellipsoid (reference mm); ``rotation`` rows are its axes in world space."""
    semi = np.asarray(semi_axes, dtype=float)
    rotation = np.eye(3) if rotation is None else np.asarray(rotation, dtype=float)
    half_extent = np.sqrt(((rotation * semi[:, None]) ** 2).sum(axis=0))
    box = grid.box(center, half_extent)
    if box is None:
        return None
    dx, dy, dz = (coordinate - np.float32(c) for coordinate, c in zip(grid.local(box), center))
    total = 0.0
    for k in range(3):
        u = rotation[k, 0] * dx + rotation[k, 1] * dy + rotation[k, 2] * dz
        total = total + (u / semi[k]) ** 2
    return box, total <= 1.0


def _tube(
    grid: _Grid, points: np.ndarray, radii: np.ndarray
) -> tuple[tuple[slice, slice, slice], np.ndarray] | None:
    """The voxels inside a swept sphere along densely sampled centreline points with varying radius."""
    low = (points - radii[:, None]).min(axis=0)
    high = (points + radii[:, None]).max(axis=0)
    box = grid.box((low + high) / 2, (high - low) / 2)
    if box is None:
        return None
    x, y, z = grid.local(box)
    nearest = np.full(tuple(s.stop - s.start for s in box), np.inf, dtype=np.float32)
    for (px, py, pz), r in zip(points, radii):
        np.minimum(nearest, ((x - px) ** 2 + (y - py) ** 2 + (z - pz) ** 2) / np.float32(r * r), out=nearest)
    return box, nearest <= 1.0


def _paint(labels: np.ndarray, shape_voxels, tissue: Tissue, allowed: np.ndarray) -> int:
    """Set ``tissue`` where the shape covers an allowed label; returns the number of voxels painted."""
    if shape_voxels is None:
        return 0
    box, inside = shape_voxels
    view = labels[box]
    claim = inside & allowed[view]
    view[claim] = tissue
    return int(claim.sum())


def _random_rotation(rng: np.random.Generator) -> np.ndarray:
    quaternion = rng.standard_normal(4)
    return Rotation.from_quat(quaternion / np.linalg.norm(quaternion)).as_matrix()


def _axis_rotation(x_deg: float = 0.0, y_deg: float = 0.0, z_deg: float = 0.0) -> np.ndarray:
    return Rotation.from_euler("xyz", [x_deg, y_deg, z_deg], degrees=True).as_matrix()


@dataclass(frozen=True)
class _Anatomy:
    """Per-patient random draws (shared by all scans of a patient), drawn in a fixed order."""

    body_jitter: float
    fat_mm: float
    organ_jitter: dict[str, float]
    position_jitter: np.ndarray  # (n_structures, 3) mm
    pancreas_jitter: np.ndarray  # (6, 3) mm
    bowel: list[tuple[np.ndarray, np.ndarray, np.ndarray, bool]]
    lesion_fraction: dict[str, float]
    lesion_direction: dict[str, np.ndarray]
    lesion_rotation: dict[str, np.ndarray]
    lesion_axes: dict[str, np.ndarray]
    disc_offset_mm: float
    # Drawn last, so that the draws above keep their values for a seed.
    placement_mm: np.ndarray  # (3,) where the anatomy sits in the field of view (table position, scan range)
    body_aspect: float  # width / depth of the body section relative to the reference
    organ_shift_mm: np.ndarray  # (n_structures, 3) mm, added to position_jitter
    # Focal lobulations of the gland: (fraction along the centreline, semi-axes mm, rotation).
    pancreas_lobules: list[tuple[float, np.ndarray, np.ndarray]]


_JITTERED = ("liver", "spleen", "kidney_left", "kidney_right", "stomach", "gall_bladder", "pancreas", "aorta")


def _draw_anatomy(rng: np.random.Generator) -> _Anatomy:
    body_jitter = float(np.clip(rng.normal(1.0, 0.035), 0.92, 1.08))
    fat_mm = float(rng.uniform(8.0, 26.0))
    organ_jitter = {name: float(np.clip(rng.normal(1.0, 0.06), 0.85, 1.15)) for name in _JITTERED}
    position_jitter = rng.normal(0.0, 3.0, size=(len(_JITTERED), 3))
    pancreas_jitter = rng.normal(0.0, 2.5, size=(6, 3))
    bowel = []
    for _ in range(int(rng.integers(7, 11))):
        center = np.array([rng.uniform(-62, 62), rng.uniform(-12, 45), rng.uniform(-92, 2)])
        semi = rng.uniform(11.0, 22.0, size=3)
        bowel.append((center, semi, _random_rotation(rng), bool(rng.random() < 0.4)))
    lesion_fraction, lesion_direction, lesion_rotation, lesion_axes = {}, {}, {}, {}
    for kind in LESION_CLASSES:
        lesion_fraction[kind] = float(rng.random())
        direction = rng.standard_normal(3)
        lesion_direction[kind] = direction / np.linalg.norm(direction)
        lesion_rotation[kind] = _random_rotation(rng)
        lesion_axes[kind] = np.array([1.0, rng.uniform(0.75, 1.0), rng.uniform(0.7, 1.0)])
    return _Anatomy(
        body_jitter=body_jitter,
        fat_mm=fat_mm,
        organ_jitter=organ_jitter,
        position_jitter=position_jitter,
        pancreas_jitter=pancreas_jitter,
        bowel=bowel,
        lesion_fraction=lesion_fraction,
        lesion_direction=lesion_direction,
        lesion_rotation=lesion_rotation,
        lesion_axes=lesion_axes,
        disc_offset_mm=float(rng.uniform(0.0, 32.0)),
        # Patients lie off-centre on the table and scan ranges differ, so different patients'
        # volumes do not line up voxel for voxel (as in real CT, where the leakage audit's NCC of two
        # different patients stays well below that of a copy).
        placement_mm=np.array([
            np.clip(rng.normal(0.0, 12.0), -24.0, 24.0),
            np.clip(rng.normal(0.0, 12.0), -24.0, 24.0),
            rng.uniform(-40.0, 40.0),
        ]),
        body_aspect=float(np.clip(rng.normal(1.0, 0.07), 0.86, 1.14)),
        organ_shift_mm=np.clip(rng.normal(0.0, 5.0, size=(len(_JITTERED), 3)), -10.0, 10.0),
        pancreas_lobules=[
            (float(rng.uniform(0.05, 0.92)),
             (5.0 + 35.0 * rng.beta(1.6, 2.4)) / 2.0 * np.array([1.0, rng.uniform(0.75, 1.0), rng.uniform(0.7, 1.0)]) + 5.0,
             _random_rotation(rng))
            for _ in range(int(rng.integers(1, 4)))
        ],
    )


def organ_size_factors(age: float, sex: str) -> dict[str, float]:
    """Designed size factors by age and sex (1.0 = reference adult), before per-patient jitter.

    The pancreas thins with age (atrophy from ~45 years), liver, kidneys and spleen shrink a
    little after 50, the aorta widens, males are ~5-9% larger, adolescents smaller. The slopes
    are chosen to be visible, not taken from a source.

    Args:
        age: true age in years.
        sex: ``F`` or ``M`` (true sex).
    """
    male = sex == "M"
    if age < 18:
        body = 0.88
    elif age <= 20:
        body = 0.95
    else:
        body = 1.0
    body *= 1.04 if male else 1.0
    organ_sex = 1.05 if male else 0.96
    return {
        "body": body,
        "pancreas": organ_sex * max(0.68, 1.0 - 0.0075 * max(age - 45.0, 0.0)),
        "liver": organ_sex * (1.0 - 0.0025 * max(age - 50.0, 0.0)),
        "kidney": organ_sex * (1.0 - 0.003 * max(age - 50.0, 0.0)),
        "spleen": organ_sex * (1.0 - 0.003 * max(age - 50.0, 0.0)),
        "stomach": organ_sex,
        "gall_bladder": 1.0,
        "aorta_radius_mm": (9.0 + (1.0 if male else 0.0) + 0.05 * max(age - 30.0, 0.0)),
        "muscle_mm": 9.0 * (1.15 if male else 1.0) * (1.0 - 0.006 * max(age - 60.0, 0.0)),
    }


# Pancreas centreline control points (reference mm, x = patient's right, y = anterior, z = superior):
# uncinate, head, neck, body, body/tail, tail tip; and the radius at each.
_PANCREAS_POINTS = np.array(
    [[34, 10, -14], [30, 18, -4], [12, 24, 4], [-14, 22, 10], [-40, 12, 16], [-58, 2, 22]], dtype=float
)
_PANCREAS_RADII = np.array([11.0, 14.0, 11.0, 10.0, 9.0, 7.5])


@dataclass
class _Layout:
    """The label map and the geometry a lesion needs (pancreas centreline, organ centres)."""

    labels: np.ndarray
    pancreas_curve: CubicSpline
    organ_centers: dict[str, np.ndarray]
    organ_semi: dict[str, np.ndarray]


def _superellipse(x: np.ndarray, y: np.ndarray, a: float, b: float, power: float = 2.3) -> np.ndarray:
    return (np.abs(x / a) ** power + np.abs(y / b) ** power) <= 1.0


_HEIGHT_MM = 300.0  # structures that run the whole height (spine, muscles, vessels)


def _body_section(grid: _Grid, anatomy: _Anatomy, factors: dict[str, float], b: float) -> np.ndarray:
    """Body cross-section (same at every z): skin, subcutaneous fat, muscle wall, cavity.

    The cavity follows the skeleton frame ``b``; fat and muscle are added outside it and capped by the view.
    """
    x2, y2 = grid.axes[0][:, None], grid.axes[1][None, :]
    cavity_a, cavity_b = 84.0 * b * anatomy.body_aspect, 60.0 * b / anatomy.body_aspect
    muscle = factors["muscle_mm"]
    # The body's size does not depend on its placement: an off-centre patient may be cut by the view's edge.
    half_view = min(grid.shape[0] * grid.spacing[0], grid.shape[1] * grid.spacing[1]) / 2.0 / grid.scale * 0.97
    fat = min(anatomy.fat_mm, half_view - muscle - max(cavity_a, cavity_b))
    section = np.zeros(grid.shape[:2], dtype=np.uint8)
    section[_superellipse(x2, y2, cavity_a + muscle + fat, cavity_b + muscle + fat)] = Tissue.SUBCUTANEOUS_FAT
    section[_superellipse(x2, y2, cavity_a + muscle, cavity_b + muscle)] = Tissue.MUSCLE
    section[_superellipse(x2, y2, cavity_a, cavity_b)] = Tissue.VISCERAL_FAT
    return np.repeat(section[:, :, None], grid.shape[2], axis=2)


def _paint_posterior_wall(labels: np.ndarray, grid: _Grid, anatomy: _Anatomy, b: float) -> None:
    """Paraspinal muscles, psoas (widening toward the pelvis), spine with discs and canal."""
    height = _HEIGHT_MM
    for side in (-1.0, 1.0):
        _paint(labels, _ellipsoid(grid, (24 * side * b, -58 * b, 0), (19 * b, 13 * b, height)), Tissue.MUSCLE,
               _ON_POSTERIOR_WALL)
        psoas_box = grid.box((32 * side * b, -34 * b, 0), (16 * b, 16 * b, height))
        if psoas_box is not None:
            x, y, z = grid.local(psoas_box)
            radius = (7.0 + 7.0 * np.clip((40.0 - z) / 120.0, 0.0, 1.0)) * b
            inside = (x - 32 * side * b) ** 2 + (y + 34 * b) ** 2 <= radius**2
            _paint(labels, (psoas_box, inside), Tissue.MUSCLE, _ON_POSTERIOR_WALL)
    spine_center = (0.0, -30.0 * b, 0.0)
    vertebra = _ellipsoid(grid, spine_center, (17 * b, 14 * b, height))
    _paint(labels, vertebra, Tissue.CORTICAL_BONE, _allowed(*Tissue))
    _paint(labels, _ellipsoid(grid, spine_center, (17 * b - 2.5, 14 * b - 2.5, height)), Tissue.CANCELLOUS_BONE,
           _allowed(Tissue.CORTICAL_BONE))
    if vertebra is not None:
        box, inside = vertebra
        z = grid.local(box)[2]
        disc = ((z - anatomy.disc_offset_mm) % (32.0 * b)) < 7.0 * b
        _paint(labels, (box, inside & disc), Tissue.DISC, _allowed(Tissue.CORTICAL_BONE, Tissue.CANCELLOUS_BONE))
    _paint(labels, _ellipsoid(grid, (0, -60 * b, 0), (14 * b, 8 * b, height)), Tissue.CORTICAL_BONE,
           _ON_POSTERIOR_WALL)
    _paint(labels, _ellipsoid(grid, (0, -68 * b, 0), (4 * b, 9 * b, height)), Tissue.CORTICAL_BONE,
           _ON_POSTERIOR_WALL)
    _paint(labels, _ellipsoid(grid, (0, -50 * b, 0), (7 * b, 6 * b, height)), Tissue.SPINAL_CANAL,
           _allowed(Tissue.CORTICAL_BONE, Tissue.MUSCLE, Tissue.VISCERAL_FAT))


def _paint_bowel(labels: np.ndarray, grid: _Grid, anatomy: _Anatomy, b: float) -> None:
    """Bowel loops in the mid and lower abdomen: unlabelled soft tissue that negatives must ignore."""
    for center, semi, rotation, gas in anatomy.bowel:
        outer = _ellipsoid(grid, center * b, semi * b, rotation)
        inner = _ellipsoid(grid, center * b, np.maximum(semi * b - 3.0, 1.0), rotation)
        _paint(labels, outer, Tissue.BOWEL_WALL, _ON_FAT)
        _paint(labels, inner, Tissue.BOWEL_GAS if gas else Tissue.BOWEL_FLUID, _allowed(Tissue.BOWEL_WALL))


def _jitter(anatomy: _Anatomy, name: str) -> np.ndarray:
    index = _JITTERED.index(name)
    return anatomy.position_jitter[index] + anatomy.organ_shift_mm[index]


def _paint_solid_organs(
    labels: np.ndarray, grid: _Grid, anatomy: _Anatomy, factors: dict[str, float], b: float
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Kidneys (first, so that the liver and spleen wrap around them), spleen, liver; their centres and semi-axes."""
    centers: dict[str, np.ndarray] = {}
    semis: dict[str, np.ndarray] = {}
    kidney_scale = factors["kidney"]
    for name, side, z_center, cortex, medulla, tilt in (
        ("kidney_right", 1.0, -4.0, Tissue.KIDNEY_RIGHT_CORTEX, Tissue.KIDNEY_RIGHT_MEDULLA, -12.0),
        ("kidney_left", -1.0, 6.0, Tissue.KIDNEY_LEFT_CORTEX, Tissue.KIDNEY_LEFT_MEDULLA, 12.0),
    ):
        center = np.array([56 * side, -28, z_center]) * b + _jitter(anatomy, name)
        semi = np.array([22, 19, 50]) * b * kidney_scale * anatomy.organ_jitter[name]
        rotation = _axis_rotation(x_deg=-10.0, y_deg=tilt)
        _paint(labels, _ellipsoid(grid, center, semi, rotation), cortex, _ON_CAVITY)
        sinus_center = center - np.array([4.0 * side, 0, 0])
        _paint(labels, _ellipsoid(grid, sinus_center, semi * 0.6, rotation), medulla, _allowed(cortex))
        centers[name], semis[name] = center, semi

    spleen_center = np.array([-64, -30, 50]) * b + _jitter(anatomy, "spleen")
    spleen_semi = np.array([18, 36, 42]) * b * factors["spleen"] * anatomy.organ_jitter["spleen"]
    _paint(labels, _ellipsoid(grid, spleen_center, spleen_semi, _axis_rotation(z_deg=-30.0)), Tissue.SPLEEN, _ON_CAVITY)

    liver_center = np.array([52, 4, 50]) * b + _jitter(anatomy, "liver")
    liver_scale = factors["liver"] * anatomy.organ_jitter["liver"]
    liver_semi = np.array([66, 66, 48]) * b * liver_scale
    # Tilted so that the right lobe reaches lower laterally than medially, as a real liver does.
    liver_rotation = _axis_rotation(y_deg=25.0)
    _paint(labels, _ellipsoid(grid, liver_center, liver_semi, liver_rotation), Tissue.LIVER, _ON_CAVITY)
    left_lobe_center = np.array([0, 40, 58]) * b + _jitter(anatomy, "liver")
    _paint(labels, _ellipsoid(grid, left_lobe_center, np.array([38, 18, 26]) * b * liver_scale), Tissue.LIVER,
           _ON_CAVITY)
    centers["liver"], semis["liver"] = liver_center, liver_semi
    return centers, semis


def _paint_hollow_organs(labels: np.ndarray, grid: _Grid, anatomy: _Anatomy, factors: dict[str, float], b: float) -> None:
    """Gall bladder and stomach (wall, fluid, and gas on the anterior, non-dependent side)."""
    gall_center = np.array([48, 42, 12]) * b + _jitter(anatomy, "gall_bladder")
    gall_semi = np.array([13, 13, 28]) * b * factors["gall_bladder"] * anatomy.organ_jitter["gall_bladder"]
    _paint(labels, _ellipsoid(grid, gall_center, gall_semi, _axis_rotation(x_deg=30.0)), Tissue.GALL_BLADDER,
           _ON_LIVER_OR_CAVITY)

    stomach_center = np.array([-32, 30, 54]) * b + _jitter(anatomy, "stomach")
    stomach_semi = np.array([32, 24, 34]) * b * factors["stomach"] * anatomy.organ_jitter["stomach"]
    _paint(labels, _ellipsoid(grid, stomach_center, stomach_semi), Tissue.STOMACH_WALL, _ON_CAVITY)
    lumen = _ellipsoid(grid, stomach_center, np.maximum(stomach_semi - 4.0, 1.0))
    _paint(labels, lumen, Tissue.STOMACH_FLUID, _allowed(Tissue.STOMACH_WALL))
    if lumen is not None:
        # The patient lies supine: gas rises to the anterior (non-dependent) part of the lumen.
        box, inside = lumen
        y = grid.local(box)[1]
        anterior = y > stomach_center[1] + 0.45 * (stomach_semi[1] - 4.0)
        _paint(labels, (box, inside & anterior), Tissue.STOMACH_GAS, _allowed(Tissue.STOMACH_FLUID))


def _paint_pancreas(labels: np.ndarray, grid: _Grid, anatomy: _Anatomy, factors: dict[str, float], b: float) -> CubicSpline:
    """The pancreas, a swept sphere along a smooth curve from the uncinate process to the tail; returns the curve."""
    control = _PANCREAS_POINTS * b + anatomy.pancreas_jitter + _jitter(anatomy, "pancreas")
    chord = np.r_[0.0, np.cumsum(np.linalg.norm(np.diff(control, axis=0), axis=1))]
    curve = CubicSpline(chord / chord[-1], control, bc_type="natural")
    radius_scale = b * factors["pancreas"] * anatomy.organ_jitter["pancreas"]
    n_samples = max(40, int(chord[-1] / (0.25 * _PANCREAS_RADII.min() * radius_scale)))
    t = np.linspace(0.0, 1.0, n_samples)
    points = curve(t)
    radii = np.interp(t, chord / chord[-1], _PANCREAS_RADII * radius_scale)
    _paint(labels, _tube(grid, points, radii), Tissue.PANCREAS, _ON_CAVITY)
    # Normal lobulation: focal bulges of parenchyma the size of a tumor with its rim (lesions.py), so
    # that a bulging contour alone does not give a tumor away (without contrast it is all there is).
    for fraction, semi, rotation in anatomy.pancreas_lobules:
        _paint(labels, _ellipsoid(grid, curve(fraction), semi * b, rotation), Tissue.PANCREAS, _ON_CAVITY)
    return curve


def _paint_vessels(labels: np.ndarray, grid: _Grid, anatomy: _Anatomy, factors: dict[str, float], b: float) -> None:
    """Aorta and IVC: they run the whole height and may cross organs (the IVC runs through the liver)."""
    aorta_radius = factors["aorta_radius_mm"] * anatomy.organ_jitter["aorta"]
    aorta_center = np.array([-10 * b, -4 * b, 0]) + _jitter(anatomy, "aorta") * np.array([1, 0.5, 0])
    _paint(labels, _ellipsoid(grid, aorta_center, (aorta_radius, aorta_radius, _HEIGHT_MM)), Tissue.AORTA,
           _ON_SOFT_ORGANS)
    cava_center = np.array([22 * b, -6 * b, 0])
    _paint(labels, _ellipsoid(grid, cava_center, (12 * b, 9 * b, _HEIGHT_MM)), Tissue.POSTCAVA, _ON_SOFT_ORGANS)


def _build_labels(plan: ScanPlan, grid: _Grid, anatomy: _Anatomy) -> _Layout:
    """The tissue label map of a patient's anatomy, painted from the body wall inward (order matters)."""
    factors = organ_size_factors(plan.age, plan.sex)
    b = factors["body"] * anatomy.body_jitter
    labels = _body_section(grid, anatomy, factors, b)
    _paint_posterior_wall(labels, grid, anatomy, b)
    _paint_bowel(labels, grid, anatomy, b)
    centers, semis = _paint_solid_organs(labels, grid, anatomy, factors, b)
    _paint_hollow_organs(labels, grid, anatomy, factors, b)
    curve = _paint_pancreas(labels, grid, anatomy, factors, b)
    _paint_vessels(labels, grid, anatomy, factors, b)

    voxels_per_tissue = np.bincount(labels.ravel(), minlength=N_TISSUES)
    for name in ORGAN_CLASSES:
        if voxels_per_tissue[list(MASK_TISSUES[name])].sum() == 0:
            raise ValueError(
                f"{plan.case_id}: organ {name} has no voxels at shape {grid.shape} and spacing "
                f"{tuple(grid.spacing)}; use a larger shape or finer spacing"
            )
    return _Layout(labels=labels, pancreas_curve=curve, organ_centers=centers, organ_semi=semis)
