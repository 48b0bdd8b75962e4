"""The ``benchx`` command line: a thin dispatcher that loads each subcommand's module by name.

Each subcommand is a module-level ``main(argv) -> int`` with its own argparse parser, so
``benchx train --help`` imports only what training needs. Loading by name keeps the dependency
direction of docs/design.md "Layering": the base package never imports :mod:`synthx`.

Errors a user can fix (a mistyped recipe key, a broken cohort, a leaking split, a missing run, ...)
are caught here, in one place, and printed as a short message with exit code 2; ``--debug`` (anywhere
on the command line, or ``BENCHX_DEBUG=1``) shows the traceback instead. The library warnings that
mean nothing to a user are filtered here too (:mod:`lightning_modules.warnings_filter`).

Example::

    benchx phantom --out data/phantom --cases 440
    benchx train --recipe recipes/unet.yaml profile=cpu
    benchx --version
"""

from __future__ import annotations

import importlib
import os
import sys

# name -> (module, function, one-line help)
COMMANDS: dict[str, tuple[str, str, str]] = {
    "phantom": ("lightning_modules.commands.phantom", "main", "write the embedded phantom cohort (layout A + metadata.csv)"),
    "import": ("lightning_modules.commands.import_cohort", "main", "import TotalSegmentator / nnU-Net / MSD / DICOM data into layout A"),
    "fetch-example": ("lightning_modules.commands.fetch_example", "main", "fetch the real TotalSegmentator example CT as case TS_EXAMPLE"),
    "validate": ("lightning_modules.commands.validate", "main", "check a cohort and list every problem at once"),
    "make-splits": ("lightning_modules.commands.make_splits", "main", "write a patient-grouped, stratified split CSV"),
    "audit": ("lightning_modules.commands.audit", "main", "leakage audit: duplicates, patient overlap, header cues (exit 1 on leakage)"),
    "recipe": ("lightning_modules.commands.recipe", "main", "print a resolved recipe (recipe show RECIPE [key=value ...])"),
    "train": ("lightning_modules.commands.train", "main", "train a backbone from a recipe (+ key=value overrides)"),
    "evaluate": ("lightning_modules.commands.evaluate", "main", "subgroup evaluation of a trained model into a new MLflow run"),
    "predict": ("lightning_modules.commands.predict", "main", "segment CT scans; masks written on each scan's own grid and affine"),
    "compare": ("lightning_modules.commands.compare", "main", "paired comparison of evaluation runs (BenchX table 6)"),
    "study": ("synthx.commands.study", "main", "the baseline-vs-SynthX study on a cohort (the main job)"),
    "report": ("synthx.commands.report", "main", "rebuild a study's HTML report from MLflow"),
    "replicates": ("synthx.commands.replicates", "main", "several finished studies (one per seed) side by side, per subgroup"),
    "sweep": ("synthx.commands.sweep", "main", "Optuna sweep over the synthesis ratio"),
    "synthx-train": ("synthx.commands.synthx_train", "main", "train the SynthX tumor generator (conditional 3D diffusion)"),
    "synthesize": ("synthx.commands.synthesize", "main", "paint conditioned synthetic tumors into healthy training scans (resumable)"),
    "synthx-quality": ("synthx.commands.synthx_quality", "main", "synthetic vs real tumors: HU, contrast, phase faithfulness, diversity"),
}

# Errors a user can fix from the message alone: printed without a traceback, exit code 2. Named by
# "module.Class" so the dispatcher need not import heavy modules to recognise them.
EXPECTED_ERRORS: frozenset[str] = frozenset(
    {
        "lightning_modules.config.loader.RecipeError",
        "lightning_modules.run_folder.RunFolderError",
        "lightning_modules.trainer.RankZeroRefusal",
        "lightning_modules.trainer.CheckpointWriteError",
        "lightning_modules.trainer.MemoryAdviceError",
        "lightning_modules.data.cohort.CohortError",
        "lightning_modules.data.splits.SplitError",
        "lightning_modules.data.importers.core.ImportSourceError",
        "lightning_modules.data.importers.core.ImportCaseError",
        "lightning_modules.data.example_ct.ExampleFetchError",
        "lightning_modules.models.checkpoints.ModelSourceError",
        "lightning_modules.inference.PredictionInputError",
        "lightning_modules.evaluation.runs.EvaluationError",
        "lightning_modules.evaluation.thresholds.ThresholdError",
        "synthx.generation.canvases.GenerationError",
        "synthx.provenance.ProvenanceError",
        "synthx.targeting.TargetingError",
        "synthx.quality.QualityError",
        "synthx.report.ReportError",
        "synthx.replicates.ReplicateError",
    }
)

# What to do next, by error type, when the message alone does not say it.
HINTS: dict[str, str] = {
    "RecipeError": "check the key against 'benchx recipe show <recipe>'",
    "CohortError": "'benchx validate --root <cohort>' lists every problem",
    "SplitError": "'benchx make-splits' writes a patient-grouped split for the cohort",
    "FolderLockedError": "wait for that process, or give this run another --out folder",
    "ModelSourceError": "name a training run (--run-id), a registered model (models:/NAME@ALIAS) or --checkpoint + --recipe",
    "MlflowException": "check the run id and MLFLOW_TRACKING_URI (or tracking.uri) point at the store that holds it",
}

EXIT_USAGE = 2


def version() -> str:
    from lightning_modules import __version__

    return f"benchx {__version__}"


def usage() -> str:
    width = max(len(name) for name in COMMANDS)
    lines = ["usage: benchx [--version] [--debug] <command> [options]", "", "commands:"]
    lines += [f"  {name.ljust(width)}  {help_}" for name, (_, _, help_) in COMMANDS.items()]
    lines += [
        "",
        "options:",
        "  --version  print the version and exit",
        "  --debug    show the full traceback of an error (also BENCHX_DEBUG=1)",
        "",
        "Run 'benchx <command> --help' for a command's options, e.g. 'benchx train --help'.",
    ]
    return "\n".join(lines)


def expected_error(error: BaseException) -> bool:
    """True for the project's own user-facing errors and for a run or model MLflow cannot find."""
    for cls in type(error).__mro__:
        if f"{cls.__module__}.{cls.__qualname__}" in EXPECTED_ERRORS:
            return True
    if type(error).__name__ == "MlflowException":
        return getattr(error, "error_code", "") in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE")
    return isinstance(error, FileNotFoundError)


def error_message(command: str, error: BaseException) -> str:
    """One or two lines: what is wrong (the error's own text) and how to fix it."""
    text = str(error).strip() or type(error).__name__
    hint = next((HINTS[cls.__name__] for cls in type(error).__mro__ if cls.__name__ in HINTS), None)
    lines = [f"benchx {command}: {text}"]
    if hint and hint not in text:
        lines.append(f"  hint: {hint}")
    lines.append("  (run again with --debug for the traceback)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv or os.environ.get("BENCHX_DEBUG", "") not in ("", "0")
    argv = [arg for arg in argv if arg != "--debug"]
    if argv and argv[0] == "--version":
        print(version())
        return 0
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"benchx: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return EXIT_USAGE
    from lightning_modules.commands.common import command_help
    from lightning_modules.warnings_filter import install

    install()
    module_name, function, _ = COMMANDS[name]
    try:
        module = importlib.import_module(module_name)
        with command_help(name, module.__doc__):
            result = getattr(module, function)(rest)
    except Exception as error:
        if debug or not expected_error(error):
            raise
        print(error_message(name, error), file=sys.stderr)
        return EXIT_USAGE
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
