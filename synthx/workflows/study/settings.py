"""What defines a study: :class:`StudySettings`, the study's constants, and the recipes derived from
the settings (the backbone of each arm, the generator).

The recipe file is loaded once per study (:func:`segmentation_recipe`); each arm's values
(:func:`arm_values`) are merged into it in memory.

Example::

    settings = StudySettings(recipe="recipes/unet.yaml", profile="cpu")
    sham = segmentation_recipe(settings, arm_values(settings, "sham", "outputs/study/synthetic/abc"))
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Mapping

from omegaconf import DictConfig, OmegaConf

from lightning_modules.data.exposure import matched_total_steps
from lightning_modules.data.metadata import normalize_phase, PHASES
from lightning_modules.recipe import load_recipe, recipe_variant
from synthx.config import load_synthx_recipe
from synthx.analysis.endpoint import PrimaryEndpoint
from synthx.painters import COPY_PASTE_PAINTER, PAINTERS, PHANTOM_PAINTER, SYNTHX_PAINTER

STEPS = ("data", "locked_cohort", "baseline", "evaluate_baseline", "targeting", "synthesize_copy_paste", "synthx_train",
         "synthesize", "sham", "augmented", "copy_paste", "evaluate_locked_baseline", "evaluate_sham", "evaluate_synthx",
         "evaluate_copy_paste", "compare")
# The steps of the copy-paste arm: none with the phantom painter (:func:`copy_paste_skipped`).
COPY_PASTE_STEPS = ("synthesize_copy_paste", "copy_paste", "evaluate_copy_paste")
COPY_PASTE_REFUSAL = (f"--painter {COPY_PASTE_PAINTER}: every SynthX study already trains a copy-paste arm (steps "
                      f"{', '.join(COPY_PASTE_STEPS)}) beside the SynthX arm, on the same targets, canvases and sites; "
                      "run the study with --painter synthx and read its arm 'copy-paste'")
TARGETS_ARTIFACT = "synthx/targets.csv"
# The locked cohort's size: the positive control's effect on arterial sensitivity detectable with 80%
# power (``python -m synthx.analysis.power``, docs/explanation/study.md "The locked test cohort").
LOCKED_CASES = 307
LOCKED_SEED_OFFSET = 1000  # the locked phantom's seed: the development phantom's seed + this
LOCKED_PREFIX = "L"  # the locked cases' and patients' ids in the evaluation view


@dataclass
class StudySettings:
    """Everything that defines a study; the steps' parameters are derived from it."""

    recipe: str = "recipes/unet.yaml"
    profile: str = "cpu"
    overrides: list[str] = field(default_factory=list)
    synthx_recipe: str = "recipes/generator/synthx.yaml"
    synthx_overrides: list[str] = field(default_factory=list)
    cases: int | None = None  # phantom cases when the cohort is generated (None: the phantom's default)
    phantom_seed: int = 0
    ratio: float = 0.3
    target: str = "need:20"
    budget: int | None = None
    synthesis_steps: int | None = None  # None: the SynthX recipe's sampling.num_inference_steps
    scheduler: str | None = None  # None: the SynthX recipe's sampling.scheduler
    experiment: str = "benchx-study"
    output_dir: str = "outputs/study"
    # "synthx": the diffusion generator is trained and paints; "phantom": the phantom's own renderer
    # paints real-appearance tumors (the positive control, synthx.generation.phantom_painter).
    painter: str = SYNTHX_PAINTER
    # Restrict the targeted cells to these contrast phases (None: every phase), e.g. ["arterial"].
    target_phases: list[str] | None = None
    # The locked test cohort (phantom cohorts only): scans, and the phantom seed (None: the
    # development phantom's seed + LOCKED_SEED_OFFSET). 0 cases: test on the split's test set.
    locked_cases: int = LOCKED_CASES
    locked_seed: int | None = None
    endpoint: PrimaryEndpoint = field(default_factory=PrimaryEndpoint)

    @property
    def locked_phantom_seed(self) -> int:
        return self.phantom_seed + LOCKED_SEED_OFFSET if self.locked_seed is None else int(self.locked_seed)

    def check(self) -> None:
        """Refuse settings that would be silently ignored."""
        if self.locked_cases and self.locked_phantom_seed == self.phantom_seed:
            raise ValueError(f"the locked test cohort needs a phantom seed other than the development cohort's "
                             f"({self.phantom_seed}); choose another --locked-seed")
        if self.locked_cases < 0:
            raise ValueError("--locked-cases must be 0 (test on the split's test set) or a number of scans")
        if not self.locked_cases and self.endpoint.test_set == "locked":
            # Without a locked cohort the endpoint is read on the split's test set, and says so.
            self.endpoint = replace(self.endpoint, test_set="split")
        if self.target_phases is not None:

            phases = [normalize_phase(p) for p in self.target_phases]
            unknown = [p for p, n in zip(self.target_phases, phases) if n not in PHASES]
            if unknown or not phases:
                raise ValueError(f"target phases must be among {', '.join(PHASES)}; got {list(self.target_phases)!r}")
            self.target_phases = sorted(set(phases), key=PHASES.index)
        if self.painter not in PAINTERS:
            raise ValueError(f"unknown painter {self.painter!r} (expected one of {', '.join(PAINTERS)})")
        if self.painter == COPY_PASTE_PAINTER:
            raise ValueError(COPY_PASTE_REFUSAL)
        if self.painter == PHANTOM_PAINTER:
            unused = [name for name, value in (
                ("--synthx-override", self.synthx_overrides), ("--synthesis-steps", self.synthesis_steps),
                ("scheduler", self.scheduler),
                ("--synthx-recipe", self.synthx_recipe if self.synthx_recipe != StudySettings.synthx_recipe else None),
            ) if value]
            if unused:
                raise ValueError(f"--painter phantom trains and samples no generator, so {', '.join(unused)} would be "
                                 "ignored; drop it or use --painter synthx")


def copy_paste_skipped(settings: StudySettings) -> str | None:
    """Why the study trains no copy-paste arm, or None when it does (every SynthX study does).

    The copy-paste arm pastes real tumors at the sites SynthX's mask prior draws; the phantom
    painter (the positive control) plans its own sites, so a copy-paste arm there would differ from
    the painted arm in placement as well as content and decompose nothing.
    """
    if settings.painter == PHANTOM_PAINTER:
        return ("the positive control's tumors sit at sites the phantom plans, not at the sites SynthX's mask prior "
                "draws, so a copy-paste arm would not isolate content; the copy-paste arm runs in the SynthX study")
    return None


def segmentation_recipe(settings: StudySettings, *variants: Mapping):
    """The backbone recipe of the study: recipe, profile, the study's experiment and overrides, loaded
    from YAML once per study; each of ``variants`` (nested typed values, e.g. an arm's
    :func:`arm_values`) is then merged in memory and checked again (:func:`recipe_variant`).

    The trainings do not validate the real cohort again (``data.validate=false``): the ``data`` step
    has just validated it, and reading every scan twice more costs minutes on a CPU. The split's
    leakage audit still runs before each training.
    """
    path = Path(settings.recipe)
    stamp = path.stat() if path.is_file() else None
    recipe = copy.deepcopy(_loaded_recipe(str(path), settings.profile, settings.experiment, tuple(settings.overrides),
                                          (stamp.st_mtime_ns, stamp.st_size) if stamp else None))
    for values in variants:
        recipe = recipe_variant(recipe, values, source=f"{settings.recipe} (study variant)")
    return recipe


@functools.lru_cache(maxsize=16)
def _loaded_recipe(path: str, profile: str, experiment: str, overrides: tuple[str, ...], stamp) -> DictConfig:
    """The study's recipe as loaded from its file (``stamp``: the file's mtime and size, so an edited
    file is read again)."""
    return load_recipe(path, [f"profile={profile}", f"tracking.experiment={experiment}", "data.validate=false",
                              *overrides])


def generator_recipe_of(settings: StudySettings, root: Path, split: Path, uri: str):
    return load_synthx_recipe(
        settings.synthx_recipe,
        [f"profile={settings.profile}", f"data.root={root}", f"data.split={split}",
         f"tracking.experiment={settings.experiment}", f"tracking.uri={uri}", *settings.synthx_overrides],
    )


def recipe_params(recipe) -> dict:
    container = OmegaConf.to_container(recipe, resolve=True, enum_to_str=True)
    container.pop("tracking", None)
    container.pop("profiles", None)
    return container


def arm_values(settings: StudySettings, arm: str, cohort: str | None = None) -> dict:
    """The recipe values of an arm on the exposure-matched schedule (``docs/explanation/synthx.md "Arms with equal real exposure"``).

    The recipe's ``trainer.max_steps`` (with the study's overrides) are the real steps S of every
    arm; the sham, SynthX and copy-paste arms train S x (1 + r) steps, their extra draws being
    synthetic slots (the copy-paste arm's variant is SynthX's with the copy-paste cohort).
    """
    real_steps = int(segmentation_recipe(settings).trainer.max_steps)
    if arm == "baseline":
        return {"synthx": {"ratio": 0.0, "real_steps": real_steps}}
    mixing = {"ratio": float(settings.ratio), "cohort": str(cohort), "real_steps": real_steps}
    if arm == "sham":
        mixing["sham"] = True
    return {"synthx": mixing, "trainer": {"max_steps": matched_total_steps(real_steps, settings.ratio)}}
