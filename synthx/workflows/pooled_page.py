"""docs/seeds.md and the README's seeds block: the page of a pooled run (``benchx study --seeds K``,
:func:`synthx.workflows.replicates.pool_replicates`): the pooled verdict per designed gap, each
replicate's own primary endpoint, the pooled sensitivity differences per phase and the pooled
decomposition, naming the runs and the commit behind them.

Example::

    write_pooled_markdown(pooled_run_id, "sqlite:///mlflow.db", "docs/seeds.md")
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pandas as pd
from mlflow.tracking import MlflowClient

from lightning_modules.evaluation.seed_pooling import comparison_name
from lightning_modules.infrastructure.monitoring import format_duration
from synthx.analysis.endpoint import family_marks, PrimaryEndpoint
from synthx.analysis.labels import arm_label, attribute_label, group_label, point_label
from synthx.analysis.verdict import Contrast, designed_gap_subgroups, outcome, study_verdict, VERDICT_WORDS
from synthx.workflows.pooled_decomposition import decomposition_markdown, POOLED_ARTIFACT
from synthx.workflows.replicates import POOLED_STAGE, REPLICATE_SEED_TAG, ReplicateError
from synthx.workflows.report.formatting import MARKS_NOTE
from synthx.workflows.report.markdown_page import fill_results_block, markdown_table
from synthx.workflows.report.runs import load_study, study_comparison as comparison_of


def pooled_markdown(run_id: str, uri: str) -> str:
    """docs/seeds.md: a pooled run's headline per designed gap, each replicate's own primary endpoint,
    and the pooled sensitivity differences per phase, naming the runs and the commit behind them."""


    client = MlflowClient(tracking_uri=uri)
    run = client.get_run(run_id)
    point = run.data.tags.get("operating_point", "val_chosen")
    studies = run.data.tags.get("replicated_studies", "").split()
    if run.data.tags.get("stage") != POOLED_STAGE or not studies:
        raise ReplicateError(f"run {run.info.run_id} is not a pooled analysis of replicates (benchx study --seeds K)")
    with tempfile.TemporaryDirectory() as folder:
        table = pd.read_csv(client.download_artifacts(run.info.run_id, f"pooled/test_{point}.csv", folder))
        artifacts = {a.path for a in client.list_artifacts(run.info.run_id, "pooled")}
        decomposition = (pd.read_csv(client.download_artifacts(run.info.run_id, parts, folder))
                         if (parts := POOLED_ARTIFACT.format(stage="test", point=point)) in artifacts else None)
        parents = [client.get_run(study) for study in studies]
        # pool_replicates logs the seeds and the studies in one order.
        labels = run.data.params.get("seeds", "").split(",")
        labels = labels if len(labels) == len(parents) else [p.data.tags.get(REPLICATE_SEED_TAG, "?") for p in parents]
        seed_lines = []
        for label, parent in zip(labels, parents):
            endpoint = PrimaryEndpoint.from_params(dict(parent.data.params))
            study = load_study(parent.info.run_id, uri, Path(folder) / parent.info.run_id)
            primary = study_verdict(comparison_of(study), point, endpoint=endpoint, subgroups=[])
            seed_lines.append(f"- Seed {label} (study run `{parent.info.run_id}`): "
                              + (primary[0] if primary else "the primary endpoint is not in its comparison."))
    seeds = [c[len("delta "):] for c in table.columns if c.startswith("delta ")]
    commits = sorted({p.data.tags.get("git_commit", "not recorded") for p in parents})
    ended = [p for p in parents if p.info.end_time]
    experiment = client.get_experiment(run.info.experiment_id).name

    def points(value) -> str:
        return "-" if pd.isna(value) else f"{100 * float(value):+.1f}"

    sensitivity = table[(table["metric"] == "sensitivity") & table["attribute"].isin(["overall", "phase"])]
    endpoint = PrimaryEndpoint.from_params(dict(parents[0].data.params))
    # (label, attribute, group, metric): the endpoint, then the designed gaps (their sensitivity).
    judged = [(f"Primary endpoint ({endpoint.metric} in {group_label(endpoint.attribute, endpoint.group)}, "
               f"{arm_label(endpoint.arm)} - {arm_label(endpoint.reference)})", endpoint.attribute, endpoint.group,
               endpoint.metric)]
    # A designed gap that is the endpoint's own subgroup is judged once, as the endpoint.
    judged += [(*gap, "sensitivity") for gap in designed_gap_subgroups()
               if point != endpoint.operating_point or (*gap[1:], "sensitivity") != judged[0][1:]]
    headline = []
    if point != endpoint.operating_point:
        headline.append(f"- The primary endpoint is set at {point_label(endpoint.operating_point)}; this run pools "
                        f"{point_label(point)}, so it judges the designed gaps only (pool with --operating-point "
                        f"{endpoint.operating_point} for the endpoint).")
        judged = judged[1:]
    for label, attribute, group, metric in judged:
        rows = table[(table["comparison"] == comparison_name(endpoint.arm, endpoint.reference)) & (table["metric"] == metric)
                     & (table["attribute"] == attribute) & (table["group"].astype(str) == group)]
        if rows.empty:
            headline.append(f"- {label}: not in the pooled table.")
            continue
        r = rows.iloc[0]
        verdict = VERDICT_WORDS[outcome(Contrast(endpoint.arm, endpoint.reference, r["mean_delta"], r["ci_low"], r["ci_high"]))]
        headline.append(f"- {label}: {arm_label(endpoint.arm)} - {arm_label(endpoint.reference)} "
                        f"{points(r['mean_delta'])} percentage points on average over {len(seeds)} seeds (95% CI "
                        f"{points(r['ci_low'])} to {points(r['ci_high'])}), above 0 in {int(r['seeds_up'])} and "
                        f"below 0 in {int(r['seeds_down'])} of them - {verdict}.")
    # Marked as a single study's tables are: Holm over each family of the pooled p-values.
    marks = family_marks(table.assign(run=table["arm"], operating_point=point, delta=table["mean_delta"]), endpoint)
    marks = marks.loc[sensitivity.index]
    rows = []
    for r, mark in zip(sensitivity.to_dict("records"), marks):
        rows.append({
            "Comparison": f"{arm_label(r['arm'])} - {arm_label(r['reference'])}",
            "Subgroup": "All scans" if r["attribute"] == "overall"
            else f"{attribute_label(r['attribute'])}: {group_label(r['attribute'], str(r['group']))}",
            "Tumor scans": int(r["positives"]),
            "Mean [95% CI]": f"{points(r['mean_delta'])} [{points(r['ci_low'])}, {points(r['ci_high'])}] {mark}".rstrip(),
            "Seeds +/-": f"{int(r['seeds_up'])}/{int(r['seeds_down'])}",
            **{f"Seed {s}": points(r[f"delta {s}"]) for s in seeds},
        })
    lines = [
        "# Seeds pooled",
        "",
        f"Generated by `benchx report --markdown` from the pooled run `{run.info.run_id}` (experiment `{experiment}`), "
        f"which pools {len(parents)} replicates of one study, seeds {', '.join(seeds)}, run at commit "
        f"{', '.join(f'`{c}`' for c in commits)}. Regenerate it rather than editing it.",
        *([f"The replicates' parent runs took {format_duration(sum(p.info.end_time - p.info.start_time for p in ended) / 1000)} "
           f"in all; from the first start to the last end {format_duration((max(p.info.end_time for p in ended) - min(p.info.start_time for p in ended)) / 1000)}."]
          if len(ended) == len(parents) else []),
        "",
        f"## Pooled verdict ({endpoint.test_set_label()}, {point_label(point)})",
        "",
        *headline,
        "",
        PER_SEED_SECTION,
        "",
        *seed_lines,
        "",
        f"## Sensitivity differences in percentage points, pooled over {len(seeds)} seeds",
        "",
        markdown_table(pd.DataFrame(rows)),
        "",
        f"Mean: the paired difference averaged over the seeds, at {point_label(point)} of each replicate "
        "(its m chosen on validation, not on the test cohort). "
        "CI: Student's t over the seeds' differences, K - 1 degrees of freedom "
        "(docs/explanation/detection-and-statistics.md \"Seeds as the unit of inference\"). "
        f"{MARKS_NOTE}, each family's Holm over the pooled p-values. "
        "Seeds +/-: seeds whose own difference is above / below 0. The replicate lines judge each seed "
        "alone with its own paired interval, as docs/results.md does for one study.",
        "",
        *(decomposition_markdown(decomposition) if decomposition is not None else []),
    ]
    return "\n".join(lines)


SEEDS_BLOCK = ("<!-- benchx-seeds:start -->", "<!-- benchx-seeds:end -->")
PER_SEED_SECTION = "## Primary endpoint, replicate by replicate"


def write_pooled_markdown(run_id: str, uri: str, out: str | Path) -> Path:
    """Write :func:`pooled_markdown` of a pooled run to ``out``; when ``out`` holds a
    :data:`SEEDS_BLOCK` (as README.md does), only that block is rewritten, with the page's pooled
    verdict (the per-seed lines and the table stay on the page)."""

    out = Path(out)
    text = pooled_markdown(run_id, uri)
    if out.is_file() and SEEDS_BLOCK[0] in out.read_text(encoding="utf-8"):
        text = fill_results_block(out.read_text(encoding="utf-8"), text.split(PER_SEED_SECTION)[0], SEEDS_BLOCK)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text, encoding="utf-8")
    return out
