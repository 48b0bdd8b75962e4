"""The decomposition pooled over replicated studies (``benchx study --seeds K``): each component of
SynthX's difference to sham (:mod:`synthx.analysis.decomposition`: placement, content, total) averaged over
the seeds with its t-interval (:func:`synthx.analysis.decomposition.pooled_decomposition`), and its section of
the pooled page.

Each replicate's pairs keep the m its own study used: at matched specificity, the two m of each
pair as the study's decomposition table (``synthx/decomposition.csv`` on its parent run) records them,
one m per arm (its m against sham), so the pooled components add up as each seed's do.

Example::

    table = pooled_decomposition_table(client, {"0": parent0, "1": parent1}, "matched_specificity", replicate_arms)
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Callable

import pandas as pd

from synthx.analysis.decomposition import pooled_decomposition
from synthx.analysis.labels import arm_label, attribute_label, group_label
from synthx.analysis.verdict import DECOMPOSITION_WORDS
from synthx.workflows.report.markdown_page import markdown_table

DECOMPOSITION_ARTIFACT = "synthx/decomposition.csv"  # each study's decomposition, on its parent run
POOLED_ARTIFACT = "pooled/decomposition_{stage}_{point}.csv"  # on the pooled run
SECTION = "## Decomposition, pooled over the seeds"

MATCHED_POINTS = ("matched_specificity", "subgroup_matched_specificity")


def decomposition_thresholds(client, parent, folder: str) -> dict[tuple[str, str], tuple[float, float]]:
    """(arm, reference) -> (reference's m, arm's m) of each pair, as the replicate's own decomposition set them.

    Raises:
        LookupError: the replicate logged no decomposition.
    """
    run_id = parent.info.run_id
    try:
        local = client.download_artifacts(run_id, DECOMPOSITION_ARTIFACT, str(Path(folder) / f"parts-{run_id}"))
    except Exception as error:  # MLflow raises several types for a missing artifact
        raise LookupError(f"replicate {run_id} has no {DECOMPOSITION_ARTIFACT} to read its pairs' m from") from error
    table = pd.read_csv(local).drop_duplicates(["arm", "reference"])
    return {(str(r.arm), str(r.reference)): (float(r.threshold_reference), float(r.threshold_arm))
            for r in table.itertuples(index=False)}


def pooled_decomposition_table(client, parents: dict, operating_point: str, arms_of: Callable, stage: str = "test",
                               **pooling) -> pd.DataFrame | None:
    """The decomposition pooled over replicates (seed label -> parent run), or None when one of them
    has no copy-paste arm (no ``evaluate_copy_paste`` step).

    Args:
        operating_point: at a matched point (``matched_specificity``, ``subgroup_matched_specificity``:
            the endpoint's, where each replicate's decomposition was made) each pair is pooled with the
            two m its replicate's decomposition used; at ``val_chosen`` and ``fixed`` every arm keeps
            its own m.
        arms_of: ``(client, parent, stage, point, folder) -> arm -> ArmRecords``
            (:func:`synthx.workflows.replicates.replicate_arms`).
        pooling: :func:`~lightning_modules.evaluation.seed_pooling.pool_seeds` keywords.
    """
    if not parents or not all("step.evaluate_copy_paste" in run.data.tags for run in parents.values()):
        return None
    with tempfile.TemporaryDirectory() as folder:
        point = "val_chosen" if operating_point in MATCHED_POINTS else operating_point
        replicates = {seed: arms_of(client, run, stage, point, folder) for seed, run in parents.items()}
        pairs = ({seed: decomposition_thresholds(client, run, folder) for seed, run in parents.items()}
                 if operating_point in MATCHED_POINTS else None)
    return pooled_decomposition(replicates, attributes=("phase",), pair_thresholds=pairs, **pooling)


def decomposition_markdown(table: pd.DataFrame) -> list[str]:
    """The pooled page's decomposition section: per component and subgroup, the mean difference over
    the seeds with its 95% CI, how many seeds lie above and below 0, and each seed's own difference."""
    seeds = [c[len("delta "):] for c in table.columns if c.startswith("delta ")]

    def points(value) -> str:
        return "-" if pd.isna(value) else f"{100 * float(value):+.1f}"

    rows = []
    for r in table.to_dict("records"):
        rows.append({
            "Component": f"{r['component']} ({DECOMPOSITION_WORDS.get(r['component'], r['component'])})",
            "Arm - reference": f"{arm_label(r['arm'])} - {arm_label(r['reference'])}",
            "Subgroup": "All scans" if r["attribute"] == "overall"
            else f"{attribute_label(r['attribute'])}: {group_label(r['attribute'], str(r['group']))}",
            "Tumor scans": int(r["positives"]),
            "Mean [95% CI]": f"{points(r['mean_delta'])} [{points(r['ci_low'])}, {points(r['ci_high'])}]",
            "Seeds +/-": f"{int(r['seeds_up'])}/{int(r['seeds_down'])}",
            **{f"Seed {s}": points(r[f"delta {s}"]) for s in seeds},
        })
    if not rows:
        return []
    return [SECTION, "", "Sensitivity differences in percentage points on the same tumors: placement is copy-paste - "
            "sham (SynthX's canvases and placement with real tumors), content SynthX - copy-paste (the generated "
            "content), total SynthX - sham; each seed's arms at the m its own study used (one m per arm, so "
            "placement + content = total in every seed and in the mean).", "",
            markdown_table(pd.DataFrame(rows)), ""]
