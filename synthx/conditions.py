"""The generator's condition names that recipes and commands check without loading torch or diffusers:
the organ each lesion class is painted into (and the mask files that make up each organ), and the
sampling schedulers a recipe may name (:mod:`synthx.generator.schedulers` builds them)."""

from __future__ import annotations

# The AbdomenAtlas mask files (docs/explanation/data.md "Cohorts on disk") that make up each organ, and the organ of each lesion class.
ORGAN_CLASSES: dict[str, tuple[str, ...]] = {
    "pancreas": ("pancreas",),
    "liver": ("liver",),
    "kidney": ("kidney_left", "kidney_right"),
}
ORGAN_OF_LESION: dict[str, str] = {
    "pancreatic_lesion": "pancreas",
    "liver_lesion": "liver",
    "kidney_lesion": "kidney",
}
# The sampling schedulers by name, in the order synthx.generator.schedulers pairs them with diffusers' classes.
SAMPLING_SCHEDULERS = ("ddpm", "ddim", "dpm_solver")
