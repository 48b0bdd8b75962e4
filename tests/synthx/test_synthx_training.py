"""SynthX generator training on a tiny cohort written here: the recipe, refusal of non-training cases,
tumor-centred patches with metadata conditions, condition dropout, a few steps lowering the loss, EMA,
and `benchx synthx-train` end to end into MLflow (recipe, case list, pipeline artifact).

Run: OMP_NUM_THREADS=1 .venv/bin/pytest tests/test_synthx_training.py -x -q
"""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import pandas as pd
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_modules.data.cohort import load_cohort, write_case, write_metadata
from lightning_modules.data.splits import load_split
from synthx.config import RecipeError, load_synthx_recipe
from synthx.generator.model import AGE_BAND_VOCAB, CONDITION_NAMES, PHASE_VOCAB, SEX_VOCAB
from synthx.training import (
    SynthXTrainingModule,
    TumorPatchDataset,
    build_dataset,
    drop_conditions,
    training_tumor_cases,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
RECIPE = REPO_ROOT / "recipes" / "generator" / "synthx.yaml"
SPACING = (2.5, 2.5, 3.0)
SHAPE = (24, 24, 16)
PATCH = 16
# Pancreas and tumor HU by phase, as in docs/explanation/data.md "The phantom cohort".
PANCREAS_HU = {"non-contrast": 45, "arterial": 130, "venous": 105, "delayed": 75}
TUMOR_HU = {"non-contrast": 40, "arterial": 70, "venous": 80, "delayed": 68}
# case id, sex, age, phase, split, has tumor
CASES = [
    ("C000", "F", 34, "arterial", "train", True),
    ("C001", "M", 67, "venous", "train", True),
    ("C002", "F", 55, "non-contrast", "train", True),
    ("C003", "", 81, "delayed", "train", True),
    ("C004", "M", 45, "venous", "train", False),
    ("V000", "F", 50, "venous", "val", True),
    ("T000", "M", 62, "arterial", "test", True),
]
TINY_MODEL = [
    "profile=cpu",
    f"data.patch_size=[{PATCH},{PATCH},{PATCH}]",
    "model.channels=[8,16]",
    "model.attention_levels=[false,true]",
    "model.norm_num_groups=8",
    "model.num_head_channels=8",
]


@pytest.fixture(scope="module")
def cohort_dir(tmp_path_factory) -> Path:
    """Seven tiny cases in layout A (a pancreas block, a tumor inside it), a synthetic one, and a split."""
    root = tmp_path_factory.mktemp("synthx_cohort")
    cohort = root / "cohort"
    cohort.mkdir()
    rng = np.random.default_rng(0)
    affine = np.diag([*SPACING, 1.0])
    grid = np.stack(np.meshgrid(*[np.arange(n) for n in SHAPE], indexing="ij"), axis=-1)
    rows, split = [], []
    for index, (case_id, sex, age, phase, part, has_tumor) in enumerate(CASES + [("S000", "F", 30, "arterial", None, True)]):
        ct = rng.normal(-60.0, 8.0, SHAPE)
        pancreas = np.zeros(SHAPE, dtype=bool)
        pancreas[4:20, 8:16, 4:12] = True
        ct[pancreas] = PANCREAS_HU[phase] + rng.normal(0.0, 5.0, pancreas.sum())
        centre = np.array([8 + 2 * (index % 4), 12, 8])
        tumor = ((((grid - centre) * SPACING) / np.array([5.0, 5.0, 5.0])) ** 2).sum(-1) <= 1.0
        tumor &= pancreas & has_tumor
        ct[tumor] = TUMOR_HU[phase] + rng.normal(0.0, 5.0, tumor.sum())
        masks = {"pancreas": pancreas}
        if has_tumor:
            masks["pancreatic_lesion"] = tumor
        write_case(cohort, case_id, np.round(ct), affine, masks)
        synthetic = case_id.startswith("S")
        rows.append(
            dict(case_id=case_id, patient_id=f"P{case_id}", sex=sex, age=age, phase=phase, tumor=int(has_tumor),
                 synthetic=int(synthetic), source_case_id="C000" if synthetic else "")
        )
        if part:
            split.append(dict(case_id=case_id, patient_id=f"P{case_id}", split=part))
    write_metadata(cohort, pd.DataFrame(rows))
    pd.DataFrame(split).to_csv(root / "split.csv", index=False)
    return root


def tiny_recipe(cohort_dir: Path, *overrides: str):
    return load_synthx_recipe(
        RECIPE, [*TINY_MODEL, f"data.root={cohort_dir / 'cohort'}", f"data.split={cohort_dir / 'split.csv'}", *overrides]
    )


def test_recipe_profiles_and_checks():
    full = load_synthx_recipe(RECIPE)
    cpu = load_synthx_recipe(RECIPE, ["profile=cpu"])
    assert full.data.patch_size == [96, 96, 96] and cpu.data.patch_size == [24, 24, 24]
    assert cpu.scheduler.prediction_type == "sample" and cpu.trainer.max_steps == 500
    assert load_synthx_recipe(RECIPE, ["profile=cpu", "trainer.max_steps=7"]).trainer.max_steps == 7
    with pytest.raises(RecipeError, match="unknown key 'data.patchsize'"):
        load_synthx_recipe(RECIPE, ["data.patchsize=[8,8,8]"])
    with pytest.raises(RecipeError, match="divisible by 8"):
        load_synthx_recipe(RECIPE, ["data.patch_size=[90,96,96]"])
    with pytest.raises(RecipeError, match="model.latent=true needs model.vae_path"):
        load_synthx_recipe(RECIPE, ["model.latent=true"])
    with pytest.raises(RecipeError, match="prediction_type"):
        load_synthx_recipe(RECIPE, ["scheduler.prediction_type=noise"])
    with pytest.raises(RecipeError, match="profile 'tpu' is not defined"):
        load_synthx_recipe(RECIPE, ["profile=tpu"])


def test_only_real_training_cases_with_tumors_are_used(cohort_dir):
    cohort = load_cohort(cohort_dir / "cohort")
    split = load_split(cohort_dir / "split.csv", cohort)
    # C004 (training, no tumor), V000 (val), T000 (test) and the synthetic S000 are left out.
    assert training_tumor_cases(cohort, split, "pancreatic_lesion") == ["C000", "C001", "C002", "C003"]
    with pytest.raises(ValueError, match=r"V000: in the 'val' split, not 'train'") as refused:
        training_tumor_cases(cohort, split, "pancreatic_lesion", ["C000", "V000", "T000"])
    assert "T000: in the 'test' split" in str(refused.value)
    with pytest.raises(ValueError, match="S000: synthetic case"):
        training_tumor_cases(cohort, split, "pancreatic_lesion", ["S000"])
    with pytest.raises(ValueError, match="C004: .*pancreatic_lesion.nii.gz is missing or empty"):
        training_tumor_cases(cohort, split, "pancreatic_lesion", ["C004"])
    with pytest.raises(ValueError, match="V000: in the 'val' split"):
        build_dataset(tiny_recipe(cohort_dir, "data.case_ids=[V000]").data, cohort, split)


def test_patches_are_tumor_centred_with_conditions_from_metadata(cohort_dir):
    cohort = load_cohort(cohort_dir / "cohort")
    dataset = TumorPatchDataset(
        cohort, ["C000", "C003"], "pancreatic_lesion", SPACING, (PATCH,) * 3, (-175, 250), inpaint_margin_mm=3.0,
        augment=True,
    )
    assert len(dataset) == 2
    torch.manual_seed(0)
    for index in range(len(dataset)):
        for _ in range(3):
            item = dataset[index]
            assert item["image"].shape == (1, PATCH, PATCH, PATCH) and item["region"].shape == (1, PATCH, PATCH, PATCH)
            assert item["image"].min() >= -1.0 and item["image"].max() <= 1.0
            region = item["region"][0].bool()
            # The whole tumor (about 4 voxels across) plus its margin sits inside the patch.
            assert 20 < int(region.sum()) < PATCH**3 // 4
            assert not region[0].any() and not region[-1].any()
    first, second = dataset[0], dataset[1]
    assert first["case_id"] == "C000" and second["case_id"] == "C003"
    assert first["sex"] == SEX_VOCAB.index("F") and first["age_band"] == AGE_BAND_VOCAB.index("20-40")
    assert first["phase"] == PHASE_VOCAB.index("arterial") and first["organ"] == 1
    assert second["sex"] == 0 and second["age_band"] == AGE_BAND_VOCAB.index("gt80")  # empty sex -> null
    assert second["phase"] == PHASE_VOCAB.index("delayed")


def test_condition_dropout_rates():
    conditions = {name: torch.full((20000,), 2, dtype=torch.long) for name in CONDITION_NAMES}
    generator = torch.Generator().manual_seed(0)
    assert all(torch.equal(v, conditions[k]) for k, v in drop_conditions(conditions, 0.0, 0.0, generator).items())
    assert all((v == 0).all() for v in drop_conditions(conditions, 0.0, 1.0, generator).values())
    dropped = drop_conditions(conditions, 0.1, 0.1, generator)
    nulled = torch.stack([dropped[name] == 0 for name in CONDITION_NAMES])
    all_null = nulled.all(0).float().mean().item()
    assert 0.09 < all_null < 0.12  # 0.1 + 0.9 * 0.1^4
    for row in nulled:
        assert 0.17 < row.float().mean().item() < 0.21  # 0.1 + 0.9 * 0.1


def test_a_few_training_steps_lower_the_loss_and_the_pipeline_carries_the_ema_weights(cohort_dir):
    pl.seed_everything(0)
    recipe = tiny_recipe(cohort_dir, "data.augment=false", "optim.warmup_steps=0", "ema.decay=0.9")
    cohort = load_cohort(recipe.data.root)
    dataset = build_dataset(recipe.data, cohort, load_split(recipe.data.split, cohort))
    loader = DataLoader(dataset, batch_size=2, shuffle=True)
    module = SynthXTrainingModule.from_recipe(recipe)
    batch = next(iter(DataLoader(dataset, batch_size=4)))
    conditions = {name: batch[name] for name in CONDITION_NAMES}
    timesteps = torch.tensor([50, 300, 600, 900])

    def fixed_loss() -> float:
        with torch.no_grad():
            return module.loss(batch, timesteps, conditions, generator=torch.Generator().manual_seed(0)).item()

    before = fixed_loss()
    trainer = pl.Trainer(
        max_steps=25, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0,
    )
    trainer.fit(module, train_dataloaders=loader)
    after = fixed_loss()
    assert trainer.global_step == 25
    assert after < 0.7 * before, f"loss {before:.4f} -> {after:.4f}"

    pipeline = module.pipeline("ddim")
    assert type(pipeline.scheduler).__name__ == "DDIMScheduler"
    assert pipeline.scheduler.config.prediction_type == "sample"
    ema_weights = [p.detach() for p in pipeline.unet.parameters()]
    assert all(torch.equal(e, s) for e, s in zip(ema_weights, module.ema.shadow_params))
    assert any(not torch.equal(e, p) for e, p in zip(ema_weights, module.denoiser.parameters()))
    assert pipeline.unet.config.hu_window == [-175.0, 250.0] and pipeline.unet.config.spacing == list(SPACING)


def test_benchx_synthx_train_logs_the_run_and_the_pipeline_to_mlflow(cohort_dir, mlflow_uri, tmp_path):
    import mlflow

    from lightning_modules.cli import main
    from synthx.generator.pipeline import SynthXPipeline

    code = main(
        [
            "synthx-train",
            "--recipe", str(RECIPE),
            "--root", str(cohort_dir / "cohort"),
            "--split", str(cohort_dir / "split.csv"),
            "--out", str(tmp_path / "run"),
            *TINY_MODEL,
            "trainer.max_steps=2",
            "trainer.log_every_n_steps=1",
            f"tracking.uri={mlflow_uri}",
        ]
    )
    assert code == 0
    client = mlflow.tracking.MlflowClient(mlflow_uri)
    runs = client.search_runs([client.get_experiment_by_name("synthx").experiment_id])
    assert len(runs) == 1
    run = runs[0]
    assert run.data.tags["variant"] == "generator" and len(run.data.tags["split_sha256"]) == 64
    assert run.data.params["n_training_cases"] == "4"
    assert "train/loss" in run.data.metrics and "perf/mean_step_seconds" in run.data.metrics
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"recipe.yaml", "training_cases.csv", "pipeline"} <= artifacts
    cases = Path(mlflow.artifacts.download_artifacts(run_id=run.info.run_id, artifact_path="training_cases.csv", tracking_uri=mlflow_uri))
    assert cases.read_text().split() == ["case_id", "C000", "C001", "C002", "C003"]
    local = mlflow.artifacts.download_artifacts(run_id=run.info.run_id, artifact_path="pipeline", tracking_uri=mlflow_uri, dst_path=str(tmp_path / "dl"))
    pipeline = SynthXPipeline.from_pretrained(local)
    pipeline.set_progress_bar_config(disable=True)
    image = np.full((PATCH,) * 3, 100.0, dtype=np.float32)
    organ = np.zeros_like(image, dtype=bool)
    organ[2:14, 2:14, 2:14] = True
    out = pipeline(image, organ, sex="M", age=70, phase="venous", num_inference_steps=2, size_class="small",
                   generator=torch.Generator().manual_seed(0))
    assert out.images.shape == (1, PATCH, PATCH, PATCH) and out.tumor_masks[0].any()


def test_latent_mode_trains_the_autoencoder_then_the_generator_on_its_latents(cohort_dir, mlflow_uri, tmp_path):
    from synthx.generator.model import SynthXAutoencoder
    from synthx.training import train_autoencoder, train_synthx

    stage_one = tiny_recipe(cohort_dir, "autoencoder.max_steps=3", f"tracking.uri={mlflow_uri}")
    trained = train_autoencoder(stage_one, output_dir=tmp_path / "ae", enable_progress_bar=False)
    assert trained.steps == 3 and trained.scaling_factor > 0
    autoencoder = SynthXAutoencoder.from_pretrained(trained.autoencoder_dir)
    assert autoencoder.config.scaling_factor == pytest.approx(trained.scaling_factor)

    stage_two = tiny_recipe(
        cohort_dir, "model.latent=true", f"model.vae_path={trained.autoencoder_dir}", "trainer.max_steps=2",
        f"tracking.uri={mlflow_uri}",
    )
    generator = train_synthx(stage_two, output_dir=tmp_path / "gen", enable_progress_bar=False)
    from synthx.generator.pipeline import SynthXPipeline

    pipeline = SynthXPipeline.from_pretrained(generator.pipeline_dir)
    pipeline.set_progress_bar_config(disable=True)
    assert isinstance(pipeline.vae, SynthXAutoencoder) and pipeline.unet.config.in_channels == 2
    image = np.full((PATCH,) * 3, 100.0, dtype=np.float32)
    organ = np.zeros_like(image, dtype=bool)
    organ[2:14, 2:14, 2:14] = True
    out = pipeline(image, organ, phase="arterial", num_inference_steps=2, generator=torch.Generator().manual_seed(0))
    assert out.images.shape == (1, PATCH, PATCH, PATCH) and np.isfinite(out.images).all()


def test_a_rerun_resumes_from_the_last_checkpoint_into_the_same_run(cohort_dir, mlflow_uri, tmp_path):
    import mlflow

    from synthx.generator.provenance import read_provenance
    from synthx.training import train_synthx

    first = train_synthx(tiny_recipe(cohort_dir, "trainer.max_steps=2", "trainer.log_every_n_steps=1", f"tracking.uri={mlflow_uri}"),
                         output_dir=tmp_path / "run", enable_progress_bar=False)
    assert first.steps == 2 and (tmp_path / "run" / "checkpoints" / "last.ckpt").exists()
    provenance = read_provenance(first.pipeline_dir)
    assert provenance.training_cases == ["C000", "C001", "C002", "C003"] and provenance.generator_run_id == first.run_id
    assert len(provenance.split_sha256) == 64 and provenance.condition_dropout_all == 0.1

    # The same recipe with more steps continues at step 2 into the same MLflow run.
    second = train_synthx(tiny_recipe(cohort_dir, "trainer.max_steps=4", "trainer.log_every_n_steps=1", f"tracking.uri={mlflow_uri}"),
                          output_dir=tmp_path / "run", enable_progress_bar=False)
    assert second.run_id == first.run_id and second.steps == 4
    client = mlflow.tracking.MlflowClient(mlflow_uri)
    run = client.get_run(first.run_id)
    assert run.data.tags["resumed"] == "true" and run.info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(first.run_id, "train/loss")][-1] >= 2
    assert len(client.search_runs([run.info.experiment_id])) == 1

    # Another recipe in the same folder is refused, unless the caller starts over.
    with pytest.raises(ValueError, match="holds a SynthX generator run of another recipe"):
        train_synthx(tiny_recipe(cohort_dir, "optim.lr=0.5", f"tracking.uri={mlflow_uri}"), output_dir=tmp_path / "run")
    fresh = train_synthx(tiny_recipe(cohort_dir, "optim.lr=0.5", "trainer.max_steps=1", f"tracking.uri={mlflow_uri}"),
                         output_dir=tmp_path / "run", resume=False, enable_progress_bar=False)
    assert fresh.run_id != first.run_id and fresh.steps == 1


def test_each_rank_loads_only_its_share_and_all_ranks_draw_equally_many_patches(cohort_dir):
    from types import SimpleNamespace

    from synthx.training import TumorPatchDataModule
    from synthx.training.dataset import EqualLengthShuffle

    recipe = tiny_recipe(cohort_dir, "data.num_workers=0", "data.balance_phases=false")
    cases = ["C000", "C001", "C002", "C003"]
    shares = {}
    for rank in (0, 1, 2):
        datamodule = TumorPatchDataModule(recipe.data, recipe.seed, cases)
        # The rank and world size a DDP trainer gives; the gather returns every rank's lesion count.
        gather = SimpleNamespace(all_gather=lambda value: torch.tensor([2, 1, 1]))
        datamodule.trainer = SimpleNamespace(global_rank=rank, world_size=3, strategy=gather)
        datamodule.setup("fit")
        shares[rank] = [region.case_id for region in datamodule.dataset.regions]
        loader = datamodule.train_dataloader()
        assert isinstance(loader.sampler, EqualLengthShuffle) and len(loader.sampler) == 2
        assert datamodule.total_lesions == 4
    assert shares == {0: ["C000", "C003"], 1: ["C001"], 2: ["C002"]}
    sampler = EqualLengthShuffle(n_items=1, length=2, seed=0)
    assert list(sampler) == [0, 0]


def test_balanced_draws_give_every_phase_an_equal_share_of_the_patches(cohort_dir):
    """``data.balance_phases`` (the default): three venous lesions (one case listed three times), one arterial
    and one non-contrast are drawn about equally often per phase; ranks keep drawing equally many patches."""
    from collections import Counter
    from types import SimpleNamespace

    from synthx.training import TumorPatchDataModule
    from synthx.training.dataset import BalancedDraws

    datamodule = TumorPatchDataModule(tiny_recipe(cohort_dir, "data.num_workers=0").data, 0, ["C000", "C001", "C001", "C001", "C002"])
    datamodule.setup("fit")
    dataset = datamodule.dataset
    phases = [dataset.regions[r].conditions["phase"] for r, _ in dataset.items]
    loader = datamodule.train_dataloader()
    assert isinstance(loader.sampler, BalancedDraws) and len(loader.sampler) == len(dataset)
    # Each venous lesion weighs a third of the arterial or the non-contrast one: weights sum to one per phase.
    weights = dataset.phase_weights()
    for phase, count in Counter(phases).items():
        assert sum(float(w) for w, p in zip(weights, phases) if p == phase) == pytest.approx(1.0), phase
    drawn = Counter(phases[i] for i in BalancedDraws(weights, length=6000, seed=0))
    assert len(drawn) == len(set(phases))
    for phase, n in drawn.items():
        assert n / 6000 == pytest.approx(1 / len(drawn), abs=0.03), (phase, drawn)
    # A new epoch draws anew; the same epoch and seed draw the same.
    sampler = BalancedDraws(weights, length=50, seed=0)
    first = list(sampler)
    assert list(sampler) == first
    sampler.set_epoch(1)
    assert list(sampler) != first
    # Under DDP every rank draws the longest share, so steps stay in lockstep.
    datamodule = TumorPatchDataModule(tiny_recipe(cohort_dir, "data.num_workers=0").data, 0, ["C000", "C001", "C002", "C003"])
    datamodule.trainer = SimpleNamespace(global_rank=1, world_size=3, strategy=SimpleNamespace(all_gather=lambda value: torch.tensor([2, 1, 1])))
    datamodule.setup("fit")
    assert len(datamodule.train_dataloader().sampler) == 2


def test_synthx_train_under_ddp_with_two_cpu_processes(cohort_dir, mlflow_uri, tmp_path):
    """Lightning's own DDP launcher (gloo), through the CLI: one MLflow run, FINISHED, with the pipeline."""
    import os
    import subprocess
    import sys

    import mlflow

    command = [
        sys.executable, "-m", "lightning_modules.cli", "synthx-train", "--recipe", str(RECIPE),
        "--root", str(cohort_dir / "cohort"), "--split", str(cohort_dir / "split.csv"), "--out", str(tmp_path / "ddp"),
        *TINY_MODEL, "trainer.max_steps=2", "trainer.devices=2", "trainer.strategy=ddp", "trainer.accelerator=cpu",
        "data.batch_size=1", f"tracking.uri={mlflow_uri}",
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1", "MASTER_PORT": str(29500 + os.getpid() % 1000)}
    env.pop("MLFLOW_RUN_ID", None)
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    client = mlflow.tracking.MlflowClient(mlflow_uri)
    runs = client.search_runs([client.get_experiment_by_name("synthx").experiment_id])
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    assert runs[0].data.params["n_training_cases"] == "4" and runs[0].data.params["n_training_lesions"] == "4"
    assert (tmp_path / "ddp" / "mlflow_run_id.txt").read_text() == runs[0].info.run_id
    assert "pipeline" in {a.path for a in client.list_artifacts(runs[0].info.run_id)}
