"""Values the schema's types let through but no run survives are refused when the recipe is loaded,
naming the key, the value and what it may be; ``benchx train`` exits 2 with that message."""

from __future__ import annotations

import pytest

from conftest import RECIPES
from lightning_modules.config.loader import RecipeError
from lightning_modules.config.recipe import check_patch_memory
from lightning_modules.recipe import load_recipe


@pytest.mark.parametrize(
    "override, message",
    [
        ("model.options.channels=[]", "model.options.channels must list at least 2 level widths, each an integer >= 1, got []"),
        ("model.options.channels=[0,8,16,32]", "model.options.channels must list at least 2 level widths"),
        ("model.options.channels=[8,16]", "model.options.strides needs one stride fewer than model.options.channels"),
        ("trainer.devices=banana", "trainer.devices must be a number of devices >= 1, -1 (all), 'auto', or a list of "
                                   "device indices such as [0, 1], got 'banana'"),
        ("trainer.devices=0", "trainer.devices must be a number of devices >= 1"),
        ("trainer.precision=17", "trainer.precision must be one of 64-true, 64, 32-true, 32, 16-mixed"),
        ("data.spacing=[1e-6,1e-6,1e-6]", "data.spacing must be > 0 mm, within [0.1, 100.0] mm, got [1e-06, 1e-06, 1e-06]"),
        ("data.patch_size=[4096,4096,4096]", "data.patch_size [4096, 4096, 4096] x 1 patches per batch is 274.9 GB"),
    ],
)
def test_a_value_no_run_survives_is_refused_with_key_value_and_range(override, message):
    with pytest.raises(RecipeError) as error:
        load_recipe(RECIPES / "unet.yaml", ["profile=cpu", "data.batch_size=1", "data.samples_per_volume=1", override])
    assert message in str(error.value)


@pytest.mark.parametrize("override", ["trainer.devices=[0,1]", "trainer.devices=auto", "trainer.devices=-1",
                                      "trainer.devices=2", "trainer.precision=bf16-mixed", "trainer.precision=16-mixed",
                                      "data.spacing=[0.5,0.5,5.0]", "model.options.channels=[4,8,16,32]"])
def test_the_usual_values_still_load(override):
    assert load_recipe(RECIPES / "unet.yaml", ["profile=cpu", override]) is not None


def test_the_patch_bound_is_half_the_available_memory():
    recipe = load_recipe(RECIPES / "unet.yaml", ["profile=cpu"])
    patch = 1
    for n in recipe.data.patch_size:
        patch *= int(n)
    batch_bytes = patch * recipe.data.batch_size * recipe.data.samples_per_volume * 4
    check_patch_memory(recipe, available=2 * batch_bytes)
    with pytest.raises(RecipeError, match=r"data.patch_size .* more than half the available memory"):
        check_patch_memory(recipe, available=2 * batch_bytes - 2)


def test_train_exits_2_naming_the_key_without_a_traceback(tmp_path, capsys):
    from lightning_modules.cli import EXIT_USAGE, main

    code = main(["train", "--recipe", str(RECIPES / "unet.yaml"), "profile=cpu", "trainer.precision=17",
                 f"tracking.output_dir={tmp_path / 'outputs'}", f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}"])
    err = capsys.readouterr().err
    assert code == EXIT_USAGE and "Traceback" not in err
    assert "trainer.precision must be one of" in err and "got '17'" in err
    assert not (tmp_path / "mlflow.db").exists(), "refused before any run was opened"
