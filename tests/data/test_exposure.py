"""Exposure-matched schedules: the baseline, sham and SynthX arms share their real draws case by case."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from mlflow.tracking import MlflowClient

from conftest import RECIPES, tiny_overrides
from lightning_modules.recipe import RecipeError, load_recipe
from lightning_modules.data.exposure import ExposureMatchedSampler, matched_total_steps, sham_substitutes


def _arms(n_real=13, batch=2, real_steps=20, ratio=0.3, seed=4):
    positives = [[1, 4], [7]]  # the real positives of synthetic case 0's cell and of case 1's
    return {
        "baseline": ExposureMatchedSampler(n_real, batch, real_steps, 0.0, seed),
        "sham": ExposureMatchedSampler(n_real, batch, real_steps, ratio, seed, n_synthetic=2, substitutes=positives),
        "synthx": ExposureMatchedSampler(n_real, batch, real_steps, ratio, seed, n_synthetic=2),
    }


def test_every_arm_draws_each_real_case_as_often_as_the_baseline():
    arms = _arms()
    assert matched_total_steps(20, 0.3) == 26
    assert [sampler.total_steps for sampler in arms.values()] == [20, 26, 26]
    tables = {name: sampler.exposures(sampler.total_steps) for name, sampler in arms.items()}
    real = {name: table["real_draws"].to_numpy()[:13] for name, table in tables.items()}
    assert real["baseline"].sum() == 40 and (real["baseline"] >= 2).all()  # 40 draws over 13 cases
    np.testing.assert_array_equal(real["sham"], real["baseline"])
    np.testing.assert_array_equal(real["synthx"], real["baseline"])
    # The real draws come in the same order in every arm: the schedule only inserts slots.
    streams = {name: sampler.stream() for name, sampler in arms.items()}
    for name in ("sham", "synthx"):
        index, case = streams[name]
        np.testing.assert_array_equal(index[case < 0], streams["baseline"][0])
    # SynthX: 12 synthetic draws, only on the synthetic cases, cycled evenly.
    synthx = tables["synthx"]
    assert synthx["slot_draws"].to_numpy()[:13].sum() == 0
    assert list(synthx["slot_draws"].to_numpy()[13:]) == [6, 6]
    # Sham: the same 12 slots, each filled by a real positive of the slot's cell.
    sham_index, sham_case = streams["sham"]
    np.testing.assert_array_equal(sham_case, streams["synthx"][1])
    slots = sham_case >= 0
    assert set(sham_index[slots & (sham_case == 0)]) <= {1, 4} and set(sham_index[slots & (sham_case == 1)]) == {7}
    sham = tables["sham"]["slot_draws"].to_numpy()
    assert len(sham) == 13 and sham.sum() == 12 and sham[7] == 6 and sham[1] + sham[4] == 6


def test_the_sampler_hands_out_the_stream_in_whole_batch_epochs():
    sampler = _arms()["synthx"]
    index, _ = sampler.stream()
    assert len(sampler) % 2 == 0
    drawn = []
    for epoch in range(-(-len(index) // len(sampler))):
        sampler.set_epoch(epoch)
        drawn.extend(sampler)
    assert drawn == index.tolist()
    # Half the training draws the first half of the stream.
    half = sampler.exposures(13)
    assert half["real_draws"].sum() + half["slot_draws"].sum() == 26
    with pytest.raises(ValueError, match="no real training positive"):
        ExposureMatchedSampler(5, 2, 4, 0.5, n_synthetic=1, substitutes=[[]])
    with pytest.raises(ValueError, match="synthetic cohort has no cases"):
        ExposureMatchedSampler(5, 2, 4, 0.5)
    with pytest.raises(ValueError, match="synthx.ratio must be >= 0"):
        ExposureMatchedSampler(5, 2, 4, -0.5, n_synthetic=1)


def test_sham_substitutes_match_the_synthetic_case_cell():
    real = pd.DataFrame({"sex": ["F", "F", "M", "M", "F"], "age": [50, 50, 70, 70, 30],
                         "phase": ["arterial", "arterial", "arterial", "venous", "venous"], "tumor": [1, 0, 1, 1, 0]})
    synthetic = pd.DataFrame({"sex": ["F", "F", "M"], "age": [55, 30, 25], "phase": ["arterial", "venous", "delayed"]})
    options, match = sham_substitutes(synthetic, real)
    assert options[0] == [0]  # F, 40-60, arterial: the one positive of that cell
    assert options[1] == [3] and match[1] == "phase"  # no F 20-40 venous positive: a venous positive
    assert options[2] == [0, 2, 3] and match[2] == "any"
    assert match[0] == "cell"


def test_recipe_refuses_steps_that_do_not_match_the_ratio(tiny_phantom, tmp_path):
    root, split = tiny_phantom
    base = tiny_overrides(root, split, tmp_path, steps=4)
    with pytest.raises(RecipeError, match="needs trainer.max_steps=5"):
        load_recipe(RECIPES / "unet.yaml", [*base, "synthx.real_steps=4", "synthx.ratio=0.25", "synthx.cohort=x"])
    with pytest.raises(RecipeError, match="synthx.sham needs"):
        load_recipe(RECIPES / "unet.yaml", [*base, "synthx.real_steps=4", "synthx.sham=true"])


def test_trainings_log_equal_real_exposures_per_case(tiny_phantom, tmp_path):
    """Baseline, sham and SynthX trainings of one seed log the same real draws per case."""
    from lightning_modules.data.exposure import EXPOSURE_ARTIFACT
    import sys

    from lightning_modules.workflows.train import train

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "synthx"))
    from test_synthx_study import fake_synthetic_cohort

    root, split = tiny_phantom
    synthetic = fake_synthetic_cohort(root, split, tmp_path / "synthetic", n=2)
    base = [*tiny_overrides(root, split, tmp_path, steps=4), "trainer.val_every_n_steps=0", "synthx.real_steps=4"]
    arms = {"baseline": [], "synthx": ["trainer.max_steps=6", "synthx.ratio=0.5", f"synthx.cohort={synthetic}"]}
    arms["sham"] = [*arms["synthx"], "synthx.sham=true"]
    tables, runs = {}, {}
    for name, extra in arms.items():
        recipe = load_recipe(RECIPES / "unet.yaml", [*base, *extra])
        result = train(recipe, output_dir=tmp_path / name, variant=name)
        client = MlflowClient(recipe.tracking.uri)
        tables[name] = pd.read_csv(client.download_artifacts(result.run_id, EXPOSURE_ARTIFACT, str(tmp_path / f"{name}-dl")))
        runs[name] = client.get_run(result.run_id)
    real = {name: table[table["synthetic"] == 0].set_index("case_id")["real_draws"] for name, table in tables.items()}
    assert real["baseline"].sum() == 4 * 2  # 4 steps of batch 2
    pd.testing.assert_series_equal(real["sham"], real["baseline"])
    pd.testing.assert_series_equal(real["synthx"], real["baseline"])
    assert tables["synthx"].loc[tables["synthx"]["synthetic"] == 1, "slot_draws"].sum() == 4
    assert set(tables["sham"]["synthetic"]) == {0}, "the sham arm loads no synthetic case"
    sham_drawn = tables["sham"].loc[tables["sham"]["slot_draws"] > 0, "case_id"]
    tumors = pd.read_csv(root / "metadata.csv").set_index("case_id")["tumor"]
    assert len(sham_drawn) and (tumors.loc[list(sham_drawn)] == 1).all(), "sham slots hold real positives"
    metrics = {name: run.data.metrics for name, run in runs.items()}
    assert metrics["baseline"]["exposure/real_draws"] == metrics["sham"]["exposure/real_draws"] == 8
    assert metrics["sham"]["exposure/sham_draws"] == 4 and metrics["sham"]["exposure/synthetic_draws"] == 0
    assert metrics["synthx"]["exposure/synthetic_draws"] == 4 and metrics["baseline"]["exposure/steps"] == 4
    assert runs["sham"].data.tags["exposure_schedule"] == "sham"


def test_the_recipe_ratio_reaches_both_samplers_as_a_float(tiny_phantom, tmp_path):
    """The datamodule hands synthx.ratio itself to the sampler: the exposure-matched one builds its
    schedule from (real_steps, r), which is the recipe's trainer.max_steps long; the plain one mixes at r."""
    import sys

    from lightning_modules.config.recipe import MixingMode
    from lightning_modules.data.mixing import ExposureMatchedSampler as MatchedInMixing, MixingSampler
    from lightning_modules.workflows.train import recipe_datamodule

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "synthx"))
    from test_synthx_study import fake_synthetic_cohort

    root, split = tiny_phantom
    synthetic = fake_synthetic_cohort(root, split, tmp_path / "synthetic", n=2)
    base = [*tiny_overrides(root, split, tmp_path, steps=8), f"synthx.cohort={synthetic}"]
    matched = load_recipe(RECIPES / "unet.yaml", [*base, "synthx.real_steps=8", "synthx.ratio=0.25", "trainer.max_steps=10"])
    datamodule = recipe_datamodule(matched)
    datamodule.setup("fit")
    sampler = datamodule.datasets["train"].sampler
    assert isinstance(sampler, MatchedInMixing)
    assert type(sampler.ratio) is float and sampler.ratio == 0.25
    assert (sampler.real_steps, sampler.total_steps) == (8, matched.trainer.max_steps)
    assert sampler.exposures(10)["slot_draws"].sum() == 2 * matched.data.batch_size  # round(0.25 x 8) slot steps
    plain = load_recipe(RECIPES / "unet.yaml", [*base, "synthx.ratio=0.5", "synthx.mode=displace"])
    datamodule = recipe_datamodule(plain)
    datamodule.setup("fit")
    sampler = datamodule.datasets["train"].sampler
    assert isinstance(sampler, MixingSampler)
    assert type(sampler.ratio) is float and sampler.ratio == 0.5 and sampler.mode is MixingMode.displace
