"""The segmentation recipe as a whole: loaded once, each section checked by the layer that owns it.

The schema and the checks of plain values are :mod:`lightning_modules.config.recipe`; the data layer
checks the exposure schedule (:func:`lightning_modules.data.exposure.check_schedule`) and the model
layer the backbone's options (:func:`lightning_modules.models.backbones.check_model_section`).
Workflows load a recipe here and hand each layer its own section (``recipe.data``, ``recipe.model``,
``recipe.trainer``, ``recipe.detection``, ``recipe.synthx``); variants (a study's arms) are merged in
memory with :func:`recipe_variant`, never written out and parsed back.

Example::

    recipe = load_recipe("recipes/unet.yaml", ["profile=cpu", "trainer.max_steps=50"])
    arm = recipe_variant(recipe, {"synthx": {"ratio": 0.3, "cohort": "data/synthetic"}})
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from omegaconf import DictConfig

from lightning_modules.config.loader import RecipeError, load_config, recipe_to_yaml, with_values
from lightning_modules.config.recipe import Recipe, check_values

__all__ = ["RecipeError", "check_recipe", "load_recipe", "recipe_to_yaml", "recipe_variant"]


def check_recipe(config: DictConfig, source: str = "recipe") -> None:
    """Every check of a recipe, without building weights: values, exposure schedule, backbone options."""
    check_values(config, source)
    # The data and model layers import torch (the backbone registry holds the networks' builders):
    # imported once the schema and the values have passed, so those errors come before torch loads.
    from lightning_modules.data.exposure import check_schedule
    from lightning_modules.models.backbones import check_model_section

    check_schedule(config.synthx, config.trainer, source)
    check_model_section(config.model, config.data, config.trainer, source)


def load_recipe(
    path: str | Path,
    overrides: list[str] | None = None,
    check: bool = True,
    resolved: bool = False,
    schema: type | None = None,
    checker=None,
    base: bool = True,
) -> DictConfig:
    """Load a segmentation recipe: schema <- _base.yaml <- recipe <- profile <- overrides.

    Args:
        path: the recipe YAML (its folder must hold ``_base.yaml`` unless the recipe is the base).
        overrides: ``key=value`` strings (dotted keys), applied last.
        check: run ``checker`` (default :func:`check_recipe`).
        resolved: the file is an already resolved recipe (the ``recipe.yaml`` a run logs): no
            ``_base.yaml`` layer and no profile is applied again, only the overrides.
        schema: another structured dataclass (default :class:`lightning_modules.config.recipe.Recipe`);
            other schemas should call :func:`lightning_modules.config.loader.load_config` directly.
        checker: ``checker(config, source)`` run when ``check``.
        base: merge ``_base.yaml`` from the recipe's folder (the backbone recipes' shared layer).

    Raises:
        RecipeError: naming the file and the key that is wrong.
    """
    return load_config(
        path,
        overrides,
        schema=schema or Recipe,
        checker=checker or check_recipe,
        check=check,
        resolved=resolved,
        base=base,
    )


def recipe_variant(recipe: DictConfig, values: Mapping[str, Any], source: str = "variant") -> DictConfig:
    """A loaded recipe with ``values`` (nested, typed) merged in memory and checked again, e.g. a
    study arm: ``recipe_variant(base, {"synthx": {"ratio": 0.3, "cohort": "data/synthetic"}})``."""
    return with_values(recipe, values, checker=check_recipe, source=source)
