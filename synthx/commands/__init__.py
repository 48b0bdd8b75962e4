"""The SynthX ``benchx`` commands, one module each: argparse, printing and exit codes only.

Each ``main(argv)`` parses and calls one library function of :mod:`synthx`. This package's command
table (:data:`COMMANDS`, :data:`EXPECTED_ERRORS`, :data:`HINTS`, as in
:mod:`lightning_modules.commands`) reaches the ``benchx`` dispatcher through the entry-point group
``benchx.commands`` declared in ``pyproject.toml``.
"""

from __future__ import annotations

# name -> (module, function, one-line help)
COMMANDS: dict[str, tuple[str, str, str]] = {
    "study": ("synthx.commands.study", "main", "the baseline-vs-SynthX study on a cohort (the main job)"),
    "report": ("synthx.commands.report", "main", "rebuild a study's HTML report from MLflow"),
    "replicates": ("synthx.commands.replicates", "main", "several finished studies (one per seed) side by side, per subgroup"),
    "sweep": ("synthx.commands.sweep", "main", "Optuna sweep over the synthesis ratio"),
    "synthx-train": ("synthx.commands.synthx_train", "main", "train the SynthX tumor generator (conditional 3D diffusion)"),
    "synthesize": ("synthx.commands.synthesize", "main", "paint conditioned synthetic tumors into healthy training scans (resumable)"),
    "synthx-quality": ("synthx.commands.synthx_quality", "main", "synthetic vs real tumors: HU, contrast, phase faithfulness, diversity"),
}

EXPECTED_ERRORS: frozenset[str] = frozenset(
    {
        "synthx.generation.canvases.GenerationError",
        "synthx.generator.provenance.ProvenanceError",
        "synthx.generation.cells.TargetingError",
        "synthx.analysis.quality.QualityError",
        "synthx.workflows.report.runs.ReportError",
        "synthx.workflows.replicates.ReplicateError",
    }
)

HINTS: dict[str, str] = {}
