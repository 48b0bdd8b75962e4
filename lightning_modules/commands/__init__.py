"""The base's ``benchx`` commands, one module each: argparse, printing and exit codes only.

Each command module has a ``main(argv) -> int`` that parses its arguments and calls one library
function. This package's command table is :data:`COMMANDS`, with the errors a user can fix from the
message alone (:data:`EXPECTED_ERRORS`, printed without a traceback, exit code 2) and what to do
next when the message does not say it (:data:`HINTS`). The dispatcher (:mod:`lightning_modules.cli`)
reads every package's table through the entry-point group ``benchx.commands`` (``pyproject.toml``),
so a package built on the base adds its own commands without the base naming them. Names only: a
table imports nothing, so ``benchx --help`` answers at once.
"""

from __future__ import annotations

# name -> (module, function, one-line help)
COMMANDS: dict[str, tuple[str, str, str]] = {
    "phantom": ("lightning_modules.commands.phantom", "main", "write the embedded phantom cohort (layout A + metadata.csv)"),
    "import": ("lightning_modules.commands.import_cohort", "main", "import TotalSegmentator / nnU-Net / MSD / DICOM data into layout A"),
    "fetch-example": ("lightning_modules.commands.fetch_example", "main", "fetch the real TotalSegmentator example CT as case TS_EXAMPLE"),
    "validate": ("lightning_modules.commands.validate", "main", "check a cohort and list every problem at once"),
    "make-splits": ("lightning_modules.commands.make_splits", "main", "write a patient-grouped, stratified split CSV"),
    "audit": ("lightning_modules.commands.audit", "main", "leakage audit: duplicates, patient overlap, header cues (exit 1 on leakage)"),
    "recipe": ("lightning_modules.commands.recipe", "main", "print a resolved recipe (recipe show --recipe RECIPE [key=value ...])"),
    "train": ("lightning_modules.commands.train", "main", "train a backbone from a recipe (+ key=value overrides)"),
    "evaluate": ("lightning_modules.commands.evaluate", "main", "subgroup evaluation of a trained model into a new MLflow run"),
    "predict": ("lightning_modules.commands.predict", "main", "segment CT scans; masks written on each scan's own grid and affine"),
    "compare": ("lightning_modules.commands.compare", "main", "paired comparison of evaluation runs (BenchX table 6)"),
}

# "module.Class" of the errors a user can fix, so the dispatcher need not import heavy modules to
# recognise them.
EXPECTED_ERRORS: frozenset[str] = frozenset(
    {
        "lightning_modules.config.loader.RecipeError",
        "lightning_modules.commands.common.ProfileConflict",
        "lightning_modules.infrastructure.run_folder.RunFolderError",
        "lightning_modules.trainer.RankZeroRefusal",
        "lightning_modules.trainer.CheckpointWriteError",
        "lightning_modules.trainer.MemoryAdviceError",
        "lightning_modules.inference.PredictionInputError",
        "lightning_modules.data.cohort.CohortError",
        "lightning_modules.data.splits.SplitError",
        "lightning_modules.data.splits.SplitSettingError",
        "lightning_modules.data.splits.SplitExistsError",
        "lightning_modules.cohorts.importers.source_cases.ImportSourceError",
        "lightning_modules.cohorts.importers.source_cases.ImportCaseError",
        "lightning_modules.cohorts.example_ct.ExampleFetchError",
        "lightning_modules.models.checkpoints.ModelSourceError",
        "lightning_modules.workflows.evaluate.EvaluationError",
        "lightning_modules.evaluation.thresholds.ThresholdError",
    }
)

# What to do next, by error class name, when the message alone does not say it.
HINTS: dict[str, str] = {
    "RecipeError": "check the key against 'benchx recipe show --recipe <recipe>'",
    "RecipeFileError": "--recipe names a YAML file, e.g. recipes/unet.yaml or recipes/generator/synthx.yaml",
    "CohortError": "'benchx validate --root <cohort>' lists every problem",
    "SplitError": "'benchx make-splits' writes a patient-grouped split for the cohort",
    "FolderLockedError": "wait for that process, or give this run another --out folder",
    "ModelSourceError": "name a training run (--run-id), a registered model (models:/NAME@ALIAS) or --checkpoint + --recipe",
    "MlflowException": "check the run id and MLFLOW_TRACKING_URI (or tracking.uri) point at the store that holds it",
}
