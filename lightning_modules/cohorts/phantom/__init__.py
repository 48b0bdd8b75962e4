"""The embedded phantom cohort: CT-like abdominal volumes with organ and lesion masks.

No public abdominal CT can ship with the project, so this package simulates a cohort in the
AbdomenAtlas layout (layout A) with its metadata (``docs/explanation/data.md "The phantom cohort"``): int16
Hounsfield-unit volumes with a body outline (subcutaneous fat, muscle wall, visceral fat, bowel
loops), the spine, the organs ``liver, pancreas, kidney_left, kidney_right, spleen, aorta, postcava,
stomach, gall_bladder`` and the lesions ``pancreatic_lesion`` (the BenchX target), ``liver_lesion``
and ``kidney_lesion``.

Designed gaps: a positive and a negative control for the study
---------------------------------------------------------------

The phantom's subgroup effects are designed, so that the baseline-vs-SynthX study has a known answer:

- **Scarcity gap (positive control): the arterial phase.** Arterial scans are rare (about 9% of
  scans, about 12% of the training positives against about 60% venous) and their tumors look
  different: in the arterial phase the tumor is hyper-attenuating, about 70 HU brighter than a
  pancreas enhanced to about 150 HU (a hypervascular, neuroendocrine-like blush), where every
  venous tumor is 50 HU darker than its gland. The tumors are clearly visible (contrast-to-noise
  ratio above 3), but a model that learned tumors from venous scans misses them; only arterial
  examples (real or synthetic) can teach it, so more of them should narrow this gap. Pancreatic
  adenocarcinoma itself is hypo-attenuating in the arterial phase: the shift is designed, not
  clinical (with a hypo-attenuating arterial tumor, measured in phantom version 3 and 4 drafts, a
  detector found arterial tumors as well as venous ones once tumors sat inside the gland).
  The study's positive control (``benchx study --painter phantom``) tests this: arterial tumors of
  this appearance added to training do make the detector find arterial tumors, but with the small
  CPU model and its 3,000 steps they can also cost it venous sensitivity, so on this phantom the gap
  is partly a capacity trade-off, not only scarcity.
- **Physics gap (negative control): the non-contrast phase.** Without contrast the tumor is
  iso-attenuating (2 HU darker than the pancreas, with the parenchyma's texture, against 9-19 HU of
  noise), and healthy glands have tumor-sized lobulations, so neither attenuation nor contour
  gives it away. No amount of training data can make it visible; a method that "closes" this gap
  is suspect.
- Venous is the well-represented reference phase (clear contrast, common); delayed is in between
  (20 HU contrast, about 11% of scans).
- A pancreatic tumor sits inside the gland: where it outgrows it, the gland expands around it with
  a rim of parenchyma (``lesions.py``), so a tumor is never a bare round blob in the fat, which is
  what a fluid-filled bowel loop looks like.

:func:`designed_gaps` returns these numbers; ``tests/cohorts/test_phantom.py`` checks them on rendered
scans (contrast per phase measured in the volumes) and in the planned cohort (arterial rarity).

What else it simulates:

- sites (cohorts) with their own scanner, noise level, blur, phase mix and demographic mix;
- organ size that follows age and sex (the pancreas atrophies with age, males are a bit larger);
- patient placement: each patient lies off-centre on the table (about 12 mm sd in x and y) with
  its own scan range (+-40 mm in z), organ positions vary by about 6 mm and the body's width-to-depth
  ratio by about 7%, so two patients do not line up voxel for voxel (the leakage audit's coarse NCC
  of different patients has a median near 0.8, where a centred phantom gave 0.975);
- skewed prevalence: venous scans and older adults are common, non-contrast and arterial scans,
  young patients and some recorded race groups are rare; about 13% of patients have a second scan
  (another phase, same anatomy and tumor, new noise), so splits must group by patient;
- Unknown values in the metadata (a recorded Unknown hides a true value that the renderer uses).

What it does not: real anatomy, real pathology, or any clinical relationship. Shapes are smooth
ellipsoids and tubes, so results on this cohort show that the machinery works, not clinical truth.
Race is a recorded label only and changes nothing in the images.

Each scan draws from random streams keyed by (seed, patient index, stream, scan number) with
:class:`numpy.random.SeedSequence`, so a cohort is deterministic for a seed, a rerun skips complete
case folders, and a resumed or partial run is byte-identical to a fresh one, for any number of render
processes and any core count (BLAS runs single-threaded). A smaller field of view
than the reference abdomen (240 x 240 x 192 mm) shrinks the whole anatomy to fit; recorded
diameters are the simulated ones in mm.

Modules: ``plan`` (sites, demographics, lesions, metadata), ``tissues`` (label map and masks),
``anatomy`` (organ shapes), ``lesions`` (where lesions go), ``intensities`` (HU per phase: the
gaps), ``render`` (one scan), ``writer`` (a cohort on disk). The command is
``lightning_modules/commands/phantom.py``.

Run::

    benchx phantom --out data/phantom --cases 440 --seed 0
    benchx phantom --out /tmp/tiny --cases 12 --shape 48 48 32
"""

from __future__ import annotations

from lightning_modules.data.cohort import ORGAN_CLASSES
from lightning_modules.cohorts.phantom.intensities import designed_gaps, lesion_contrast_hu, phase_attenuation
from lightning_modules.cohorts.phantom.plan import (
    CASE_ID_PREFIX,
    DEFAULT_CASES,
    LESION_CLASSES,
    METADATA_COLUMNS,
    PATIENT_ID_PREFIX,
    REFERENCE_FOV_MM,
    SITES,
    SITES_BY_NAME,
    LesionPlan,
    ScanPlan,
    Site,
    geometry_scale,
    metadata_table,
    plan_phantom_cohort,
    sample_phantom_metadata,
)
from lightning_modules.cohorts.phantom.anatomy import organ_size_factors
from lightning_modules.cohorts.phantom.render import PhantomScan, render_scan
from lightning_modules.cohorts.phantom.tissues import MASK_TISSUES, N_TISSUES, Tissue
from lightning_modules.cohorts.phantom.writer import PARAMS_FILE, PHANTOM_VERSION, generate_phantom_cohort, summarize

__all__ = [
    "CASE_ID_PREFIX", "DEFAULT_CASES", "LESION_CLASSES", "MASK_TISSUES", "METADATA_COLUMNS", "N_TISSUES",
    "ORGAN_CLASSES", "PARAMS_FILE", "PATIENT_ID_PREFIX", "PHANTOM_VERSION", "REFERENCE_FOV_MM", "SITES",
    "SITES_BY_NAME", "LesionPlan", "PhantomScan", "ScanPlan", "Site", "Tissue", "designed_gaps",
    "generate_phantom_cohort", "geometry_scale", "lesion_contrast_hu", "metadata_table", "organ_size_factors",
    "phase_attenuation", "plan_phantom_cohort", "render_scan", "sample_phantom_metadata", "summarize",
]
