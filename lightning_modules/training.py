"""``benchx train``: train a backbone from a recipe on a cohort + split, tracked in MLflow, resumable.

Before the first step the cohort is validated and the split audited for patient overlap and
duplicates; a broken cohort or a leaking split is refused with the full list of problems (the
leakage check can be overridden with ``data.allow_leakage=true``, which is recorded in MLflow).

Each run has an output folder ``<tracking.output_dir>/<recipe name>-<fingerprint>`` (the fingerprint
is a hash of the resolved recipe), holding ``checkpoints/last.ckpt`` and ``best.ckpt`` and the MLflow
run id. Running the same command again after an interruption resumes from ``last.ckpt`` into the
same MLflow run, at the same step.

Example::

    benchx train --recipe recipes/unet.yaml profile=cpu trainer.max_steps=200
    mlflow run . -e train -P recipe=recipes/unet.yaml -P overrides="profile=cpu" --env-manager local
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback, LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.loggers import MLFlowLogger
from omegaconf import DictConfig, OmegaConf

from lightning_modules.data.cohort import CohortError
from lightning_modules.data.datamodule import CohortDataModule
from lightning_modules.evaluation.callback import SubgroupEvaluation
from lightning_modules.evaluation.provenance import log_training_cases
from lightning_modules.data.mixing import log_dataset_inputs, mixing_datamodule
from lightning_modules.config.recipe import load_recipe, recipe_to_yaml
from lightning_modules.models.segmentation_module import SegmentationModule
from lightning_modules.models.checkpoints import build_module
from lightning_modules.monitoring import system_callbacks
from lightning_modules.tracking import experiment_id, flatten, run_tags, tracking_uri

RUN_ID_FILE = "mlflow_run_id.txt"


@dataclass
class TrainResult:
    """What a training run leaves behind."""

    run_id: str
    output_dir: Path
    best_checkpoint: Path | None
    last_checkpoint: Path
    metrics: dict[str, float] = field(default_factory=dict)
    global_step: int = 0


def recipe_fingerprint(recipe: DictConfig) -> str:
    """A short hash of the resolved recipe (without tracking settings): same recipe -> same folder."""
    container = OmegaConf.to_container(recipe, resolve=True)
    container.pop("tracking", None)
    container.pop("profiles", None)
    return hashlib.sha256(json.dumps(container, sort_keys=True).encode()).hexdigest()[:10]


def default_output_dir(recipe: DictConfig) -> Path:
    return Path(recipe.tracking.output_dir) / f"{recipe.name}-{recipe_fingerprint(recipe)}"



def check_data(recipe: DictConfig, cohort, split) -> list[str]:
    """Validate the cohort and audit the split before training. Returns the leakage findings that
    were overridden (empty when clean); raises CohortError on a broken cohort or unapproved leakage."""
    from lightning_modules.data.audit import check_split_leakage
    from lightning_modules.data.validation import validate_cohort

    if recipe.data.validate:
        problems = validate_cohort(cohort, classes=list(recipe.data.classes))
        if problems:
            raise CohortError(problems, cohort.root)
    leakage = _cached(
        Path(recipe.tracking.output_dir) / ".leakage_checks", _leakage_key(cohort, split), lambda: check_split_leakage(cohort, split)
    )
    if leakage and not recipe.data.allow_leakage:
        raise CohortError(
            [*leakage, "training refused: fix the split, or set data.allow_leakage=true to override (recorded in MLflow)"],
            cohort.root,
        )
    return list(leakage)


def _leakage_key(cohort, split) -> str:
    """Content key of a leakage check: the split rows, the metadata, and each CT's size and mtime."""
    digest = hashlib.sha256()
    digest.update(split.sort_values("case_id").to_csv(index=False).encode())
    digest.update(cohort.metadata.to_csv(index=False).encode())
    for case in cohort.cases():
        stat = case.ct_path.stat() if case.ct_path.exists() else None
        digest.update(f"{case.case_id}:{stat.st_size if stat else -1}:{stat.st_mtime_ns if stat else -1}".encode())
    return digest.hexdigest()[:24]


def _cached(folder: Path, key: str, compute) -> list[str]:
    """The patient/duplicate leakage findings, computed once per content key (reading every CT is slow)."""
    from lightning_modules.data.cohort import atomic_write_bytes

    path = folder / f"{key}.json"
    if path.exists():
        return list(json.loads(path.read_text()))
    findings = [str(f) for f in compute()]
    atomic_write_bytes(path, json.dumps(findings).encode())
    return findings


def train(
    recipe: DictConfig,
    output_dir: str | Path | None = None,
    callbacks: Sequence[Callback] = (),
    datamodule: CohortDataModule | None = None,
    resume: bool = True,
    variant: str | None = None,
    extra_tags: dict[str, str] | None = None,
    after_run_start: Callable[[MLFlowLogger], None] | None = None,
    trainer_overrides: dict | None = None,
    evaluation: bool = True,
    run_id: str | None = None,
) -> TrainResult:
    """Train the recipe's backbone; resume from ``last.ckpt`` in ``output_dir`` when present.

    Args:
        recipe: a loaded recipe.
        output_dir: run folder (default: ``default_output_dir(recipe)``).
        callbacks: extra Lightning callbacks (e.g. the subgroup evaluation, an Optuna pruner).
        datamodule: a prepared datamodule (default: the recipe's cohort and split).
        resume: continue from ``last.ckpt`` into the same MLflow run when it exists.
        variant: ``baseline`` or ``synthx`` (default: from ``synthx.ratio``).
        extra_tags: more MLflow tags (e.g. a parent run id, an Optuna trial number).
        after_run_start: called with the logger once the MLflow run exists (e.g. to log dataset inputs).
        trainer_overrides: keyword arguments passed to ``pl.Trainer`` over the recipe's.
        evaluation: add the SubgroupEvaluation callback (subgroup detection metrics at each validation).
        run_id: log into this existing MLflow run (``benchx train`` passes the run that
            ``mlflow run`` opened, ``MLFLOW_RUN_ID``); default: a new run.
    """
    from lightning_modules.data.splits import split_sha256

    from lightning_modules.models.backbones.nnunet import resolve_planned_recipe

    pl.seed_everything(int(recipe.seed), workers=True)
    output_dir = Path(output_dir) if output_dir else default_output_dir(recipe)
    checkpoint_dir = output_dir / "checkpoints"
    last = checkpoint_dir / "last.ckpt"
    # nnU-Net / ResEnc with `auto` topology: plan patch size and stages from the training cases
    # (deterministic, so a resumed run plans the same network).
    split_table = datamodule.split if datamodule is not None and datamodule.split is not None else None
    if split_table is None:
        from lightning_modules.data.splits import load_split

        split_table = load_split(recipe.data.split)
    recipe, plan = resolve_planned_recipe(recipe, case_ids=list(split_table.loc[split_table["split"] == "train", "case_id"]))
    if datamodule is not None:
        datamodule.recipe = recipe
    datamodule = datamodule or mixing_datamodule(recipe)
    datamodule._load()
    overridden = check_data(recipe, datamodule.cohort, datamodule.split)

    uri = tracking_uri(recipe.tracking.uri)
    experiment = str(recipe.tracking.experiment)
    experiment_id(experiment, uri)
    run_id_path = output_dir / RUN_ID_FILE
    resuming = resume and last.exists() and run_id_path.exists()
    run_id = run_id_path.read_text().strip() if resuming else run_id
    tags = run_tags(recipe, split_sha256(recipe.data.split), variant)
    tags.update(extra_tags or {})
    logger = MLFlowLogger(
        experiment_name=experiment,
        tracking_uri=uri,
        run_name=recipe.tracking.run_name or f"train-{recipe.name}-{tags['variant']}",
        run_id=run_id,
        tags=tags if run_id is None else None,
        log_model=False,
    )
    run_id = logger.run_id
    output_dir.mkdir(parents=True, exist_ok=True)
    run_id_path.write_text(run_id)
    client = logger.experiment
    if not resuming:
        if run_id is not None:
            for key, value in tags.items():
                client.set_tag(run_id, key, value)
        logger.log_hyperparams(flatten(OmegaConf.to_container(recipe, resolve=True)))
        client.log_text(run_id, recipe_to_yaml(recipe), "recipe.yaml")
        if plan is not None:
            client.log_dict(run_id, plan, "nnunet_plan.json")
        if overridden:
            client.set_tag(run_id, "leakage_override", "true")
            client.log_text(run_id, "\n".join(overridden), "leakage_override.txt")
        log_dataset_inputs(client, run_id, datamodule, str(recipe.data.split))
        log_training_cases(client, run_id, datamodule.split)
        if after_run_start is not None:
            after_run_start(logger)
    else:
        client.set_tag(run_id, "resumed", "true")

    module = build_module(recipe)
    tumor = recipe.data.tumor_class
    best = ModelCheckpoint(
        dirpath=checkpoint_dir,
        filename="best",
        monitor=f"val/dice/{tumor}",
        mode="max",
        save_top_k=1,
        save_last=True,
        enable_version_counter=False,
    )
    # A second writer of last.ckpt on a step interval, so an interruption between validations
    # loses at most `checkpoint_every_n_steps` steps.
    periodic = ModelCheckpoint(
        dirpath=checkpoint_dir,
        save_top_k=0,
        save_last=True,
        every_n_train_steps=int(recipe.trainer.checkpoint_every_n_steps),
        enable_version_counter=False,
    )
    if evaluation:
        callbacks = [SubgroupEvaluation.from_recipe(recipe), *callbacks]
    trainer_kwargs = dict(
        max_steps=int(recipe.trainer.max_steps),
        val_check_interval=int(recipe.trainer.val_every_n_steps),
        check_val_every_n_epoch=None,
        num_sanity_val_steps=0,
        accelerator=recipe.trainer.accelerator,
        devices=recipe.trainer.devices,
        strategy=recipe.trainer.strategy,
        precision=recipe.trainer.precision,
        log_every_n_steps=int(recipe.trainer.log_every_n_steps),
        gradient_clip_val=recipe.trainer.gradient_clip_val,
        deterministic=bool(recipe.trainer.deterministic),
        default_root_dir=str(output_dir),
        logger=logger,
        callbacks=[best, periodic, LearningRateMonitor(logging_interval="step"), *system_callbacks(recipe.trainer.accelerator, 10 * int(recipe.trainer.log_every_n_steps)), *callbacks],
        enable_model_summary=False,
        enable_progress_bar=bool(recipe.trainer.progress_bar) and sys.stderr.isatty(),
    )
    trainer_kwargs.update(trainer_overrides or {})
    trainer = pl.Trainer(**trainer_kwargs)
    trainer.fit(module, datamodule=datamodule, ckpt_path=str(last) if resuming else None)

    best_path = Path(best.best_model_path) if best.best_model_path else None
    if trainer.is_global_zero:
        if best_path and best_path.exists():
            client.log_artifact(run_id, str(best_path), "checkpoints")
        if last.exists():
            client.log_artifact(run_id, str(last), "checkpoints")
        from lightning_modules.models.pyfunc import log_segmentation_model

        log_segmentation_model(run_id, uri, recipe, best_path if best_path and best_path.exists() else last, recipe_to_yaml(recipe))
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if getattr(v, "numel", lambda: 1)() == 1}
    return TrainResult(run_id, output_dir, best_path, last, metrics, trainer.global_step)



def parse_args(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(
        prog="benchx train",
        description="Train a backbone from a recipe. Trailing key=value pairs override the recipe "
        "(e.g. profile=cpu trainer.max_steps=100 data.root=/data/AbdomenAtlas).",
    )
    parser.add_argument("--recipe", required=True, help="recipe YAML, e.g. recipes/unet.yaml")
    parser.add_argument("--out", default=None, help="run folder (default: outputs/<recipe>-<hash>)")
    parser.add_argument("--fresh", action="store_true", help="do not resume from an existing last.ckpt")
    parser.add_argument("overrides", nargs="*", help="key=value recipe overrides")
    return parser.parse_known_args(list(argv))


def main(argv: Sequence[str] | None = None) -> int:
    from lightning_modules.commands.common import split_overrides

    args, unknown = parse_args(sys.argv[1:] if argv is None else argv)
    overrides = split_overrides([*args.overrides, *unknown])
    # A RecipeError or CohortError goes to the dispatcher (lightning_modules.cli): a short message, exit 2.
    recipe = load_recipe(args.recipe, overrides)
    # Under `mlflow run`, log into the run it opened (Lightning would otherwise start another).
    result = train(recipe, output_dir=args.out, resume=not args.fresh, run_id=os.environ.get("MLFLOW_RUN_ID"))
    print(f"run {result.run_id}: {result.global_step} steps, best checkpoint {result.best_checkpoint}")
    for key in sorted(result.metrics):
        if key.startswith("val/"):
            print(f"  {key} = {result.metrics[key]:.4f}")
    return 0
