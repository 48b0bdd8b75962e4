"""The study report and what a finished study publishes: readable run names, headline metrics on
the parent run, registry aliases on the right versions, a self-contained HTML report (also rebuilt by
``benchx report``), and "not available" for an item a study did not log."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pandas as pd
import pytest
from mlflow.tracking import MlflowClient

from tiny_study import finished_study  # noqa: F401  (fixture)


def test_runs_are_named_and_the_parent_carries_the_headline(finished_study):
    settings, uri, parent_id = finished_study
    client = MlflowClient(uri)
    parent = client.get_run(parent_id)
    assert parent.info.run_name == "study-unet"
    steps = {k[len("step."):]: v for k, v in parent.data.tags.items() if k.startswith("step.")}
    names = {step: client.get_run(run_id).info.run_name for step, run_id in steps.items()}
    # Short, the arm first (the UI cuts long names at their end); the arms are compared on the locked test cohort.
    assert names["baseline"] == "baseline-train-unet" and names["augmented"] == "synthx-train-unet"
    assert names["sham"] == "sham-train-unet"
    assert names["evaluate_baseline"] == "baseline-evaluate-unet-test"
    assert names["evaluate_synthx"] == "synthx-evaluate-unet-locked"
    assert names["evaluate_sham"] == "sham-evaluate-unet-locked"
    assert names["copy_paste"] == "copy_paste-train-unet" and names["evaluate_copy_paste"] == "copy_paste-evaluate-unet-locked"

    from synthx.workflows.report.runs import headline

    with pytest.MonkeyPatch.context():
        path = client.download_artifacts(steps["compare"], "comparison/test_comparison.csv", str(settings.output_dir))
    comparison = pd.read_csv(path, keep_default_na=False, na_values=[""])
    expected = headline(comparison)
    metrics = parent.data.metrics
    for row in expected.itertuples(index=False):
        for variant in ("baseline", "synthx", "delta"):
            value = getattr(row, variant)
            key = f"{variant}/test/{row.metric}_worst/{row.attribute}"
            if value == value:  # defined
                assert metrics[key] == pytest.approx(value), key
    # The worst group is the minimum over the attribute's defined groups.
    from synthx.workflows.report.runs import primary_point

    primary, _ = primary_point(comparison)
    phase = primary[(primary["attribute"] == "phase") & (primary["metric"] == "sensitivity") & (primary["positives"] > 0)
                    & (primary["reference"] == "baseline")]  # the baseline's own values (not sham's, as a reference)
    if phase["a"].notna().any():
        assert metrics["baseline/test/sensitivity_worst/phase"] == pytest.approx(phase["a"].min())


def test_aliases_point_at_the_study_versions(finished_study):
    settings, uri, parent_id = finished_study
    client = MlflowClient(uri)
    tags = client.get_run(parent_id).data.tags
    baseline = client.get_model_version_by_alias("benchx-unet", f"{settings.experiment}-baseline")
    assert baseline.run_id == tags["step.baseline"]
    assert client.get_model_version_by_alias("benchx-unet", f"{settings.experiment}-synthx").run_id == tags["step.augmented"]
    assert client.get_model_version_by_alias("synthx-generator", settings.experiment).run_id == tags["step.synthx_train"]
    copy_paste = client.get_model_version_by_alias("benchx-unet", f"{settings.experiment}-copy_paste")
    assert copy_paste.run_id == tags["step.copy_paste"]
    assert client.get_model_version("benchx-unet", copy_paste.version).description.startswith(
        f"copy-paste arm of study {settings.experiment}")
    # Scoped by experiment: no bare alias another experiment's study would move.
    aliases = set(client.get_registered_model("benchx-unet").aliases)
    assert not {"baseline", "synthx"} & aliases, aliases
    # The version says what it is: arm, recipe, data and the validation-chosen operating point.
    chosen = client.get_run(tags["step.evaluate_baseline"]).data.metrics["operating_point/val_chosen"]
    description = client.get_model_version("benchx-unet", baseline.version).description
    assert description.startswith(f"baseline arm of study {settings.experiment}"), description
    assert "Recipe: unet" in description and "Data: " in description and "split sha256" in description
    assert f"m = {chosen:,.0f} mm³ chosen on validation" in description, description
    # Every arm's version states the m that a model loaded from its alias applies (not the recipe's).
    from lightning_modules.tracking.operating_point import applied_operating_point

    for arm in ("baseline", "sham", "synthx"):
        alias = f"{settings.experiment}-{arm}"
        applied, source = applied_operating_point(f"models:/benchx-unet@{alias}", uri, 50.0)
        stated = client.get_model_version_by_alias("benchx-unet", alias).description
        assert source.startswith("registered model"), (arm, source)
        assert f"m = {applied:,.0f} mm³ chosen on validation" in stated, (arm, stated)
    evaluated = client.get_run(tags["step.evaluate_synthx"]).data.tags
    version = client.get_model_version_by_alias("benchx-unet", f"{settings.experiment}-synthx").version
    assert evaluated.get("model_version") == str(version) and evaluated.get("registered_model") == "benchx-unet"
    inputs = client.get_run(tags["step.evaluate_synthx"]).inputs.dataset_inputs
    contexts = {t.value for d in inputs for t in d.tags if t.key == "mlflow.data.context"}
    assert {"evaluation-val", "evaluation-test"} <= contexts


def test_the_report_is_self_contained_and_rebuilt_by_benchx_report(finished_study, tmp_path):
    settings, uri, parent_id = finished_study
    from pathlib import Path

    written = Path(settings.output_dir) / "study_report.html"
    text = written.read_text()
    for title in ("Baseline by subgroup (test)", "Tumors found per subgroup", "Arms compared (BenchX table 6)",
                  "Forest plots per operating point", "ROC curves per phase and arm", "Training curves",
                  "Synthetic cohort", "Unfillable cells", "Real and synthetic tumors per phase", "Quality summary",
                  "Decomposition (test)", "Realism of the painted tumors", "Real against copy-paste", "Leakage audit",
                  "Recipes", "Versions"):
        assert title in text, title
    # The baseline figure, a forest plot per operating point, ROC, training curves and real/synthetic examples.
    assert len(re.findall(r'src="data:image/png;base64,', text)) >= 7
    # Tables people read: labels, not keys; % not fractions; one forest plot per operating point.
    assert "Age: 20 or younger" in text and "Phase: arterial" in text
    assert not re.search(r"<td>le20</td>|<th>sensitivity_ci_low</th>", text)
    # The primary comparison is SynthX against sham; baseline against sham shows the schedule alone.
    assert text.count("<h3>SynthX minus sham at ") == 4, "fixed, validation-chosen, matched and subgroup-matched specificity"
    assert text.count("<h3>copy-paste minus sham at ") == 4, "the copy-paste arm has its own forest plots"
    # The quality summary: measured contrast of real and synthetic tumors (HU) side by side.
    assert re.search(r"<td>all phases</td>\s*<td>\d+ / \d+</td>\s*<td>[+-]\d+</td>\s*<td>[+-]\d+</td>", text)
    assert not re.search(r'src="(?!data:)', text), "no external resources"
    assert "not available" not in text, re.findall(r"not available[^<]*", text)

    from lightning_modules.cli import main

    out = tmp_path / "again.html"
    assert main(["report", "--run-id", parent_id, "--out", str(out), "--tracking-uri", uri]) == 0
    rebuilt = out.read_text()
    assert "Arms compared" in rebuilt and rebuilt.count("data:image/png;base64,") == text.count("data:image/png;base64,")
    artifacts = {a.path for a in MlflowClient(uri).list_artifacts(parent_id, "report")}
    assert "report/study_report.html" in artifacts


def test_a_missing_item_is_reported_as_not_available(finished_study, tmp_path):
    settings, uri, parent_id = finished_study
    client = MlflowClient(uri)
    # A copy of the parent that names no synthesis step and a compare run without its table.
    experiment = client.create_experiment("report-partial")  # not beside the study's runs in the UI
    tags = {k: v for k, v in client.get_run(parent_id).data.tags.items() if k.startswith("step.") and k != "step.synthesize"}
    empty = client.create_run(experiment, run_name="compare-empty").info.run_id
    tags["step.compare"] = empty
    partial = client.create_run(experiment, run_name="study-partial", tags=tags).info.run_id
    client.set_terminated(empty)
    client.set_terminated(partial)
    from synthx.workflows.report.html_page import build_report

    text = build_report(partial, uri, tmp_path / "partial.html", log=False).read_text()
    assert "not available: the study has no &#x27;synthesize&#x27; step" in text or "no 'synthesize' step" in text
    assert "comparison/test_comparison.csv" in text and "Baseline by subgroup" in text


def test_report_of_a_run_that_is_not_a_study_exits_2(finished_study, capsys):
    _, uri, parent_id = finished_study
    client = MlflowClient(uri)
    other = client.get_run(parent_id).data.tags["step.baseline"]
    from lightning_modules.cli import main

    assert main(["report", "--run-id", other, "--tracking-uri", uri, "--no-log"]) == 2
    err = capsys.readouterr().err
    assert "names no study steps" in err and "parent run" in err and "Traceback" not in err


def test_versions_name_a_package_that_is_not_installed(monkeypatch):
    """A package the report lists but this environment lacks is shown as such, not silently left out."""
    import importlib.metadata as metadata
    from types import SimpleNamespace

    from synthx.workflows.report import html_page as report

    real_version = metadata.version

    def version(package):
        if package == "diffusers":
            raise metadata.PackageNotFoundError(package)
        return real_version(package)

    monkeypatch.setattr(metadata, "version", version)
    study = SimpleNamespace(parent=SimpleNamespace(data=SimpleNamespace(tags={"git_commit": "abc123"})), steps={})
    page = report.versions_html(study)
    assert re.search(r"diffusers \(report built with\)</td>\s*<td>not installed", page), page
    assert "torch (report built with)" in page and "abc123" in page


def _comparison(client, parent_id, folder) -> pd.DataFrame:
    compare = client.get_run(parent_id).data.tags["step.compare"]
    path = client.download_artifacts(compare, "comparison/test_comparison.csv", str(folder))
    return pd.read_csv(path, keep_default_na=False, na_values=[""])


def _decomposition_lines(client, parent_id, folder) -> list[str]:
    """The verdict's decomposition sentences of the study's own decomposition table."""
    from synthx.analysis.endpoint import PrimaryEndpoint
    from synthx.analysis.verdict import decomposition_sentences

    path = client.download_artifacts(parent_id, "synthx/decomposition.csv", str(folder / "decomposition"))
    point = PrimaryEndpoint.from_params(client.get_run(parent_id).data.params).operating_point  # where it was made
    return decomposition_sentences(pd.read_csv(path, keep_default_na=False, na_values=[""]), point=point)


def test_the_verdict_opens_the_report_and_is_the_parent_s_description(finished_study, tmp_path):
    import html
    from pathlib import Path

    from synthx.analysis.verdict import study_verdict

    settings, uri, parent_id = finished_study
    client = MlflowClient(uri)
    lines = study_verdict(_comparison(client, parent_id, tmp_path), "val_chosen")
    assert [re.split("[,:]", line)[0] for line in lines] == ["Scarcity gap (arterial)", "Physics gap (non-contrast)",
                                                              "Primary endpoint (sensitivity in arterial)"]
    assert all(re.search(r" - (closed|not closed|undetermined)( \(SynthX - sham |\.$)", line) for line in lines), lines
    parts = _decomposition_lines(client, parent_id, tmp_path)
    assert parts and parts[0].startswith("Scarcity gap (arterial), decomposed on")
    assert client.get_run(parent_id).data.tags["mlflow.note.content"] == "\n\n".join(lines + parts)
    text = (Path(settings.output_dir) / "study_report.html").read_text()
    first_section = text.index("<h2>")
    assert text[first_section:].startswith("<h2>Verdict (test)</h2>"), text[first_section:first_section + 80]
    assert html.escape(lines[0]) in text[:text.index("Arms compared")]


def test_benchx_report_markdown_writes_the_results_page(finished_study, tmp_path):
    from lightning_modules.cli import main
    from synthx.workflows.report.formatting import pct as _pct
    from synthx.analysis.verdict import study_verdict

    settings, uri, parent_id = finished_study
    client = MlflowClient(uri)
    out = tmp_path / "docs" / "results.md"
    assert main(["report", "--run-id", parent_id, "--markdown", str(out), "--tracking-uri", uri]) == 0
    page = out.read_text()
    parent = client.get_run(parent_id)
    assert page.startswith("# Results\n")
    assert f"`{parent_id}`" in page and f"`{parent.data.tags['git_commit']}`" in page, "names the run and commit"
    seconds = round((parent.info.end_time - parent.info.start_time) / 1000)
    took = f"{seconds // 60} min {seconds % 60:02d} s" if seconds >= 60 else f"{seconds} s"
    assert f"The study took {took} from the start of its parent run to its end" in page
    comparison = _comparison(client, parent_id, tmp_path)
    verdict = page.split("## Verdict (test set)\n\n")[1].split("\n\n")[0].splitlines()
    lines = study_verdict(comparison, "val_chosen") + _decomposition_lines(client, parent_id, tmp_path)
    assert verdict == [f"- {line}" for line in lines]
    table = [line for line in page.splitlines() if line.startswith("|")]
    assert table[0] == ("| Subgroup | Tumor scans | Healthy scans | sham | SynthX | copy-paste | baseline "
                        "| SynthX - sham [Newcombe 95% CI] | copy-paste - sham [Newcombe 95% CI] "
                        "| baseline - sham [Newcombe 95% CI] |")
    rows = {line.split(" | ")[0].lstrip("| "): line.strip("| ").split(" | ") for line in table[2:]}
    assert "All scans" in rows and "Phase: arterial" in rows, rows
    at = comparison[(comparison["operating_point"] == "val_chosen") & (comparison["metric"] == "sensitivity")]
    arterial = at[(at["group"] == "arterial") & (at["run"] == "synthx")].iloc[0]
    assert rows["Phase: arterial"][1:5] == [str(int(arterial["positives"])), str(int(arterial["negatives"])),
                                            _pct(arterial["a"]), _pct(arterial["b"])]
    assert "at the validation-chosen operating point" in page


def test_evaluation_runs_log_headline_metrics_and_the_full_table(finished_study, tmp_path):
    """A few hundred keys a person can plot, not thousands; the full table is an MLflow table."""
    _, uri, parent_id = finished_study
    client = MlflowClient(uri)
    run_id = client.get_run(parent_id).data.tags["step.evaluate_baseline"]
    metrics = client.get_run(run_id).data.metrics
    assert 20 < len(metrics) < 500, len(metrics)
    assert not [k for k in metrics if "_ci_" in k], "CIs live in the table, not in metrics"
    for key in ("test_val_chosen/sensitivity/phase/venous", "test_val_chosen/auc/overall",
                "test_val_chosen/specificity_worst/phase", "test_val_chosen/f1_gap/phase", "test_fixed/sensitivity/overall",
                "operating_point/val_chosen", "test/threshold"):
        assert key in metrics, key
    assert "test_fixed/sensitivity/phase/venous" not in metrics, "per group only at the validation-chosen point"
    table = json.loads(Path(client.download_artifacts(run_id, "evaluation/test_val_chosen_subgroups.json", str(tmp_path))).read_text())
    columns = table["columns"]
    assert {"attribute", "group", "sensitivity", "sensitivity_ci_low", "auc"} <= set(columns)
    venous = dict(zip(columns, next(r for r in table["data"] if r[columns.index("group")] == "venous")))
    assert metrics["test_val_chosen/sensitivity/phase/venous"] == pytest.approx(venous["sensitivity"])


def test_the_results_block_of_a_readme_is_filled_in_place():
    from synthx.workflows.report.markdown_page import RESULTS_BLOCK, fill_results_block
    from synthx.workflows.report.runs import ReportError

    start, end = RESULTS_BLOCK
    readme = f"# Project\n\nintro\n\n{start}\nold figures\n{end}\n\n## After\n"
    page = "# Results\n\nGenerated by `benchx report --markdown` from run `abc`.\n\n## Verdict (test set)\n\n- closed\n"
    filled = fill_results_block(readme, page)
    assert filled.startswith("# Project\n\nintro\n\n") and filled.endswith(f"{end}\n\n## After\n")
    block = filled.split(start)[1].split(end)[0]
    assert "old figures" not in block and "# Results" not in block
    assert "**Verdict (test set)**" in block and "- closed" in block and "from run `abc`" in block
    assert fill_results_block(filled, page) == filled  # idempotent
    with pytest.raises(ReportError, match="exactly one"):
        fill_results_block("no markers here", page)
