"""The ``benchx`` command line: a thin dispatcher that loads each subcommand's module by name.

Each subcommand is a module-level ``main(argv) -> int`` with its own argparse parser, so
``benchx train --help`` imports only what training needs. Loading by name keeps the dependency
direction of ``docs/design.md "Layering"``: the base package never imports :mod:`synthx`.

Example::

    benchx phantom --out data/phantom --cases 440
    benchx train --recipe recipes/unet.yaml profile=cpu
"""

from __future__ import annotations

import importlib
import sys

# name -> (module, function, one-line help)
COMMANDS: dict[str, tuple[str, str, str]] = {
    "phantom": ("lightning_modules.commands.phantom", "main", "write the embedded phantom cohort (layout A + metadata.csv)"),
    "import": ("lightning_modules.commands.import_cohort", "main", "import TotalSegmentator / nnU-Net / MSD / DICOM data into layout A"),
    "fetch-example": ("lightning_modules.commands.fetch_example", "main", "fetch the real TotalSegmentator example CT as case TS_EXAMPLE"),
    "validate": ("lightning_modules.commands.validate", "main", "check a cohort and list every problem at once"),
    "make-splits": ("lightning_modules.commands.make_splits", "main", "write a patient-grouped, stratified split CSV"),
    "audit": ("lightning_modules.commands.audit", "main", "leakage audit: duplicates, patient overlap, header cues (exit 1 on leakage)"),
    "train": ("lightning_modules.commands.train", "main", "train a backbone from a recipe (+ key=value overrides)"),
    "evaluate": ("lightning_modules.commands.evaluate", "main", "subgroup evaluation of a trained model into a new MLflow run"),
    "predict": ("lightning_modules.commands.predict", "main", "segment CT scans; masks written on each scan's own grid and affine"),
    "compare": ("lightning_modules.commands.compare", "main", "paired comparison of evaluation runs (BenchX table 6)"),
    "study": ("synthx.commands.study", "main", "the baseline-vs-SynthX study on a cohort (the main job)"),
    "sweep": ("synthx.commands.sweep", "main", "Optuna sweep over the synthesis ratio"),
    "synthx-train": ("synthx.commands.synthx_train", "main", "train the SynthX tumor generator (conditional 3D diffusion)"),
    "synthesize": ("synthx.commands.synthesize", "main", "paint conditioned synthetic tumors into healthy training scans (resumable)"),
    "synthx-quality": ("synthx.commands.synthx_quality", "main", "synthetic vs real tumors: HU, contrast, phase faithfulness, diversity"),
}


def usage() -> str:
    width = max(len(name) for name in COMMANDS)
    lines = ["usage: benchx <command> [options]", "", "commands:"]
    lines += [f"  {name.ljust(width)}  {help_}" for name, (_, _, help_) in COMMANDS.items()]
    lines += ["", "Run 'benchx <command> --help' for a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"benchx: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module_name, function, _ = COMMANDS[name]
    module = importlib.import_module(module_name)
    result = getattr(module, function)(rest)
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
