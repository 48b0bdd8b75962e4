"""The segmentation recipe refuses, at load, every value and file a user can get wrong, with a message
naming the file, the key and what it must be."""

from __future__ import annotations

import pytest

from conftest import RECIPES
from lightning_modules.config.recipe import RANGES, RecipeError
from lightning_modules.recipe import load_recipe, recipe_to_yaml


@pytest.mark.parametrize(
    "override, message",
    [
        ("optim.lr=-1", "optim.lr must be a finite number > 0, got -1"),
        ("optim.lr=nan", "optim.lr must be a finite number > 0, got nan"),
        ("optim.lr=0", "optim.lr must be a finite number > 0"),
        ("data.batch_size=0", "data.batch_size must be >= 1, got 0"),
        ("trainer.max_steps=-5", "trainer.max_steps must be >= 1, got -5"),
        ("data.patch_size=[0,32,32]", r"data.patch_size must be >= 1 voxel, got \[0, 32, 32\]"),
        ("data.spacing=[1.5,-1,1.5]", "data.spacing must be > 0 mm"),
        ("trainer.sw_overlap=1", r"trainer.sw_overlap must be in \[0, 1\)"),
        ("detection.confidence=1.5", r"detection.confidence must be in \(0, 1\)"),
        ("detection.threshold_mm3=inf", "detection.threshold_mm3 must be a finite number"),
        ("data.hu_window=[250,-175]", "data.hu_window must be two finite HU values, low < high"),
        ("trainer.gradient_clip_val=0", "trainer.gradient_clip_val must be a finite number > 0"),
        ("synthx.ratio=-0.1", r"synthx.ratio must be in \[0, 1\] \(displace\) or \[0, 10\] \(add\)"),
    ],
)
def test_a_value_out_of_range_is_refused_naming_the_key(override, message):
    with pytest.raises(RecipeError, match=rf"unet.yaml: {message}"):
        load_recipe(RECIPES / "unet.yaml", ["profile=cpu", override])


ENUM_FIELDS = [
    ("data.normalization", "window or ct"), ("data.cache", "memory, disk or none"), ("optim.name", "sgd or adamw"),
    ("optim.schedule", "poly, cosine or constant"), ("detection.threshold_rule", "fixed, f1 or youden"),
    ("detection.score", "volume or max_prob"), ("synthx.mode", "add or displace"),
]


@pytest.mark.parametrize("key, choices", ENUM_FIELDS)
def test_a_choice_outside_its_enum_is_refused_by_the_schema_naming_the_key_and_the_choices(key, choices):
    with pytest.raises(RecipeError, match=rf"^command line: {key} must be {choices}, got 'ram'$"):
        load_recipe(RECIPES / "unet.yaml", ["profile=cpu", f"{key}=ram"])


def test_a_choice_in_a_recipe_file_is_named_with_the_file_and_a_valid_one_compares_as_its_text(tmp_path):
    (tmp_path / "bad.yaml").write_text("data:\n  cache: ram\n")
    with pytest.raises(RecipeError, match=rf"^{tmp_path / 'bad.yaml'}: data.cache must be memory, disk or none"):
        load_recipe(tmp_path / "bad.yaml", base=False)
    recipe = load_recipe(RECIPES / "unet.yaml", ["profile=cpu", "data.cache=disk", "synthx.mode=displace"])
    assert recipe.data.cache == "disk" and f"{recipe.synthx.mode}" == "displace"
    from lightning_modules.config.recipe import CacheMode, MixingMode

    assert recipe.data.cache is CacheMode.disk and recipe.synthx.mode is MixingMode.displace
    assert "cache: disk" in recipe_to_yaml(recipe), "a resolved recipe spells the choice as the file did"


def test_every_enum_field_of_the_schema_is_listed():
    import dataclasses
    import enum
    import typing

    from lightning_modules.config.recipe import Recipe

    found = []
    for section in dataclasses.fields(Recipe):
        kind = typing.get_type_hints(Recipe)[section.name]
        if dataclasses.is_dataclass(kind):
            for name, hint in typing.get_type_hints(kind).items():
                if isinstance(hint, type) and issubclass(hint, enum.Enum):
                    found.append(f"{section.name}.{name}")
    assert sorted(found) == sorted(key for key, _ in ENUM_FIELDS)


def test_every_range_names_a_key_of_the_schema_and_the_shipped_recipes_pass():
    from omegaconf import OmegaConf

    recipe = load_recipe(RECIPES / "unet.yaml")
    for key, _, _ in RANGES:
        assert OmegaConf.select(recipe, key, default="missing") != "missing", key
    for path in sorted(RECIPES.glob("*.yaml")):
        for profile in ("full", "cpu"):
            load_recipe(path, [f"profile={profile}"])


def test_the_documented_edge_values_are_accepted():
    recipe = load_recipe(RECIPES / "unet.yaml", ["profile=cpu", "trainer.val_every_n_steps=0", "optim.momentum=0",
                                                 "detection.threshold_bootstrap=0", "trainer.gradient_clip_val=null"])
    assert recipe.trainer.val_every_n_steps == 0 and recipe.trainer.gradient_clip_val is None


@pytest.mark.parametrize(
    "text, message",
    [
        ("data: [1\n", r"not valid YAML \(line 2, column 1\)"),
        ("- 1\n- 2\n", "the top level must be a mapping of settings"),
        ("tracking:\n  uri: ${oc.env:BENCHX_TEST_UNSET_VARIABLE}\n", "cannot resolve 'tracking.uri'.*BENCHX_TEST_UNSET_VARIABLE"),
    ],
    ids=["malformed-yaml", "top-level-list", "unset-environment-variable"],
)
def test_a_broken_recipe_file_is_refused_naming_the_file(tmp_path, monkeypatch, text, message):
    monkeypatch.delenv("BENCHX_TEST_UNSET_VARIABLE", raising=False)
    (tmp_path / "mine.yaml").write_text(text)
    with pytest.raises(RecipeError, match=rf"mine.yaml: {message}"):
        load_recipe(tmp_path / "mine.yaml")


def test_a_directory_as_recipe_is_refused(tmp_path):
    (tmp_path / "recipes.yaml").mkdir()
    with pytest.raises(RecipeError, match="is not a file"):
        load_recipe(tmp_path / "recipes.yaml")


def test_a_variant_is_merged_in_memory_typed_and_checked_like_a_file():
    from omegaconf import OmegaConf

    from lightning_modules.recipe import recipe_variant

    base = load_recipe(RECIPES / "unet.yaml", ["profile=cpu"])
    before = OmegaConf.to_yaml(base)
    arm = recipe_variant(base, {"synthx": {"ratio": 0.5, "cohort": "data/synthetic", "real_steps": 10},
                                "trainer": {"max_steps": 15}})
    assert arm.synthx.ratio == 0.5 and isinstance(arm.synthx.ratio, float) and arm.trainer.max_steps == 15
    assert OmegaConf.to_yaml(base) == before, "the loaded recipe is left as it was"
    # The same values as dotlist overrides on the file give the same recipe.
    assert arm == load_recipe(RECIPES / "unet.yaml", ["profile=cpu", "synthx.ratio=0.5", "synthx.cohort=data/synthetic",
                                                       "synthx.real_steps=10", "trainer.max_steps=15"])
    with pytest.raises(RecipeError, match=r"synthx.ratio must be in \[0, 1\] \(displace\) or \[0, 10\] \(add\), got 11"):
        recipe_variant(base, {"synthx": {"ratio": 11.0}})
    with pytest.raises(RecipeError, match=r"needs trainer.max_steps=15"):
        recipe_variant(base, {"synthx": {"ratio": 0.5, "real_steps": 10}})
    with pytest.raises(RecipeError, match="unknown key 'synthx.rato'"):
        recipe_variant(base, {"synthx": {"rato": 0.5}})
