"""The SynthX recipe: every key of recipes/generator/synthx.yaml (and of its schema) is read by the code that uses it.

A key nobody reads is a setting a user can change without effect. Each recipe section is mapped to
the functions that consume it, and the test checks that one of them reads each key of the section.

Run: .venv/bin/pytest tests/synthx/test_synthx_config.py -q
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from lightning_modules.trainer import build_trainer
from synthx.commands import synthx_quality
from synthx.config import SynthXRecipe, load_synthx_recipe
from synthx.generation.run import SynthesisSettings
from synthx.generator.schedulers import build_noise_scheduler
from synthx.training import dataset, modules, run

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "generator" / "synthx.yaml"

# recipe section -> the functions that consume it (the loader consumes `profiles` itself).
READERS = {
    "name": [run._logger],
    "profile": [run._logger],
    "seed": [run.train_synthx, run.train_autoencoder, dataset.TumorPatchDataModule.train_dataloader, SynthesisSettings.from_recipe],
    "data": [dataset.recipe_training_cases, dataset.patch_dataset, dataset.TumorPatchDataModule.setup,
             dataset.TumorPatchDataModule.train_dataloader, run._fit, run._logger, modules.build_denoiser],
    "model": [modules.build_denoiser, modules.load_autoencoder],
    "autoencoder": [modules.SynthXAutoencoderModule.from_recipe, run.train_autoencoder],
    "scheduler": [build_noise_scheduler],
    "condition_dropout": [modules.SynthXTrainingModule.from_recipe, run.train_synthx],
    "loss": [modules.SynthXTrainingModule.from_recipe, modules.SynthXAutoencoderModule.from_recipe],
    "optim": [modules.SynthXTrainingModule.from_recipe],
    "ema": [modules.SynthXTrainingModule.from_recipe],
    "trainer": [run._trainer, run.train_synthx, build_trainer],  # build_trainer: the shared Trainer construction
    "sampling": [SynthesisSettings.from_recipe, run.train_synthx],
    "mask_prior": [SynthesisSettings.from_recipe],
    "quality_filter": [synthx_quality.main],
    "tracking": [run._logger, run.run_folder, SynthesisSettings.from_recipe],
}


def _leaves(config, prefix=()):
    """Dotted key paths down to the values (a dict-valued setting such as size_class_weights counts as one key)."""
    for key, value in config.items():
        path = (*prefix, str(key))
        if isinstance(value, dict) and path[0] != "profiles" and len(path) < 2:
            yield from _leaves(value, path)
        elif isinstance(value, dict) and path[0] == "profiles":
            yield from _leaves(value, path)
        else:
            yield path


def _reads(path: tuple[str, ...]) -> bool:
    name = path[-1] if len(path) == 1 else path[1]
    pattern = re.compile(rf"\.{re.escape(name)}\b|\[[\"']{re.escape(name)}[\"']\]|get\([\"']{re.escape(name)}[\"']")
    return any(pattern.search(inspect.getsource(reader)) for reader in READERS[path[0]])


def _recipe_keys() -> set[tuple[str, ...]]:
    yaml_keys = set()
    for path in _leaves(OmegaConf.to_container(OmegaConf.load(RECIPE))):
        if path[0] == "profiles":
            path = path[2:]  # profiles.<name>.<section>.<key> sets <section>.<key>
        yaml_keys.add(path[:2])
    schema_keys = {path[:2] for path in _leaves(OmegaConf.to_container(OmegaConf.structured(SynthXRecipe))) if path[0] != "profiles"}
    return yaml_keys | schema_keys


@pytest.mark.parametrize("path", sorted(_recipe_keys()), ids=".".join)
def test_every_recipe_key_is_read(path):
    assert path[0] in READERS, f"recipe section {path[0]!r} has no reader listed: who uses it?"
    assert _reads(path), f"recipe key {'.'.join(path)} is read by none of {[r.__qualname__ for r in READERS[path[0]]]}"


def test_the_check_catches_an_unread_key():
    assert not _reads(("sampling", "temperature")) and _reads(("sampling", "guidance_scale"))


def test_ddp_keys_exist_and_profiles_load():
    recipe = load_synthx_recipe(RECIPE, ["profile=cpu", "trainer.devices=2", "trainer.strategy=ddp", "trainer.num_nodes=1"])
    assert (recipe.trainer.devices, recipe.trainer.strategy, recipe.trainer.num_nodes) == (2, "ddp", 1)
    assert recipe.sampling.guidance_scale > 1 and recipe.condition_dropout.all > 0


def test_size_weights_are_read_only_from_the_weights_source():
    """mask_prior.size_class_weights is used with size_source=weights; changing it under the default
    size_source=training (the training tumors' sizes) would have no effect, so it is refused."""
    from synthx.config import RecipeError

    default = load_synthx_recipe(RECIPE, ["profile=cpu"])
    assert default.mask_prior.size_source == "training"
    chosen = load_synthx_recipe(RECIPE, ["profile=cpu", "mask_prior.size_source=weights", "mask_prior.size_class_weights.tiny=0"])
    assert chosen.mask_prior.size_class_weights.tiny == 0
    with pytest.raises(RecipeError, match="size_class_weights .* would be ignored"):
        load_synthx_recipe(RECIPE, ["profile=cpu", "mask_prior.size_class_weights.tiny=0"])
    with pytest.raises(RecipeError, match="mask_prior.size_source must be training or weights, got 'test'"):
        load_synthx_recipe(RECIPE, ["profile=cpu", "mask_prior.size_source=test"])


@pytest.mark.parametrize("key, choices", [
    ("scheduler.prediction_type", "epsilon, sample or v_prediction"),
    ("sampling.scheduler", "ddpm, ddim or dpm_solver"),
    ("mask_prior.size_source", "training or weights"),
])
def test_a_choice_outside_its_enum_is_refused_naming_the_key_and_the_choices(key, choices):
    from synthx.config import RecipeError

    with pytest.raises(RecipeError, match=rf"^command line: {key} must be {choices}, got 'nope'$"):
        load_synthx_recipe(RECIPE, ["profile=cpu", f"{key}=nope"])


def test_the_sampling_scheduler_choices_are_the_scheduler_classes():
    from synthx.config import SamplingScheduler
    from synthx.generator.schedulers import SAMPLING_SCHEDULER_CLASSES, sampling_scheduler

    recipe = load_synthx_recipe(RECIPE, ["profile=cpu", "sampling.scheduler=dpm_solver"])
    assert [member.value for member in SamplingScheduler] == list(SAMPLING_SCHEDULER_CLASSES)
    scheduler = sampling_scheduler(recipe.sampling.scheduler, build_noise_scheduler(recipe.scheduler))
    assert type(scheduler) is SAMPLING_SCHEDULER_CLASSES["dpm_solver"]
