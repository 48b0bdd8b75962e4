"""Mixing synthetic cases into training: additive epochs keep every real case once, displacing ones draw by chance.

Run: .venv/bin/pytest tests/data/test_mixing.py -q
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from lightning_modules.recipe import RecipeError, load_recipe
from lightning_modules.data.mixing import MixingSampler

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "unet.yaml"


@pytest.mark.parametrize("ratio", [0.3, 1.0, 2.5])
def test_additive_mixing_keeps_every_real_case_once_per_epoch(ratio):
    reported = []
    sampler = MixingSampler(n_real=40, n_synthetic=7, ratio=ratio, seed=3, mode="add", report=lambda *a: reported.append(a))
    orders = []
    for epoch in range(4):
        sampler.set_epoch(epoch)
        order = list(sampler)
        orders.append(order)
        real = Counter(i for i in order if i < 40)
        synthetic = Counter(i for i in order if i >= 40)
        assert sorted(real) == list(range(40)) and set(real.values()) == {1}  # each real case exactly once
        assert sum(synthetic.values()) == round(ratio * 40) and len(order) == len(sampler)
        assert set(synthetic) <= set(range(40, 47))
        # Synthetic cases are cycled through: none is seen more than once more than another.
        counts = [synthetic.get(i, 0) for i in range(40, 47)]
        assert max(counts) - min(counts) <= 1
    assert reported == [(epoch, 40, round(ratio * 40)) for epoch in range(4)] == sampler.history
    assert orders[0] != orders[1]  # epochs differ
    sampler.set_epoch(0)
    assert list(sampler) == orders[0]  # and are reproducible


def test_displacing_mixing_stays_available_and_loses_real_exposures():
    sampler = MixingSampler(n_real=1000, n_synthetic=5, ratio=0.3, seed=0, mode="displace")
    order = list(sampler)
    synthetic = sum(i >= 1000 for i in order)
    assert len(order) == len(sampler) == 1000
    assert 250 < synthetic < 350 and len({i for i in order if i < 1000}) < 1000 - 200


def test_bad_modes_and_ratios_are_refused():
    with pytest.raises(ValueError, match="mode"):
        MixingSampler(10, 2, 0.3, mode="replace")
    with pytest.raises(ValueError, match="no cases"):
        MixingSampler(10, 0, 0.3)
    assert len(MixingSampler(10, 2, 1.5, mode="add")) == 25
    assert load_recipe(RECIPE, ["profile=cpu", "synthx.ratio=1.5"]).synthx.mode == "add"
    with pytest.raises(RecipeError, match="synthx.ratio"):
        load_recipe(RECIPE, ["profile=cpu", "synthx.ratio=1.5", "synthx.mode=displace"])
    with pytest.raises(RecipeError, match="synthx.mode"):
        load_recipe(RECIPE, ["profile=cpu", "synthx.mode=replace"])


def test_training_with_additive_mixing_logs_each_epochs_exposures(tiny_phantom, tmp_path):
    import shutil

    import mlflow
    import pandas as pd

    from conftest import tiny_overrides
    from lightning_modules.data.cohort import load_cohort, write_metadata
    from lightning_modules.data.splits import split_sha256
    from lightning_modules.data.synthetic_provenance import GeneratorProvenance
    from lightning_modules.workflows.train import train

    root, split = tiny_phantom
    table = pd.read_csv(split)
    train_ids = list(table.loc[table["split"] == "train", "case_id"])
    cohort, synthetic = load_cohort(root), tmp_path / "synthetic"
    synthetic.mkdir()
    rows = []
    for index, canvas in enumerate(train_ids[:2]):  # copies of real training scans, marked synthetic
        shutil.copytree(root / canvas, synthetic / f"SX{index:04d}")
        row = cohort.row(canvas)
        rows.append({"case_id": f"SX{index:04d}", "patient_id": row["patient_id"], "sex": row["sex"], "age": row["age"],
                     "phase": row["phase"], "synthetic": 1, "source_case_id": canvas, "generator_run_id": ""})
    write_metadata(synthetic, pd.DataFrame(rows))
    # As benchx synthesize records it: the generator learned from training cases of this split.
    GeneratorProvenance(training_cases=train_ids[:2], split_sha256=split_sha256(split)).write(synthetic)
    steps = 2 * len(train_ids)  # about two epochs at batch size 2 with r = 1
    recipe = load_recipe(RECIPE, [*tiny_overrides(root, split, tmp_path, steps=steps), "synthx.ratio=1.0", f"synthx.cohort={synthetic}",
                                  "data.batch_size=2", "data.cache=none"])
    result = train(recipe, evaluation=False)
    client = mlflow.tracking.MlflowClient(recipe.tracking.uri)
    real = client.get_metric_history(result.run_id, "mixing/real_exposures")
    synth = client.get_metric_history(result.run_id, "mixing/synthetic_exposures")
    assert len(real) >= 2 and {m.value for m in real} == {float(len(train_ids))}
    assert {m.value for m in synth} == {float(len(train_ids))}  # r = 1: as many synthetic draws as real cases
