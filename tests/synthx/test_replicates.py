"""Several finished studies side by side (``benchx replicates``): the summary across studies is
computed from each study's own comparison rows, and studies that cannot be lined up are refused."""

from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tiny_study import finished_study  # noqa: E402,F401  (fixture)

from synthx.replicates import ReplicateError, format_replicates, replicate_table, study_comparison  # noqa: E402


def comparison(study: str, seed: int, deltas: dict[str, float], significant: tuple[str, ...] = (),
               negatives: int = 14) -> pd.DataFrame:
    """A study's comparison rows at the fixed point: AUC per phase with the given differences."""
    rows = []
    for group, delta in deltas.items():
        rows.append({"study": study, "seed": str(seed), "ratio": "0.3", "operating_point": "fixed",
                     "attribute": "phase", "group": group, "metric": "auc", "n_patients": 20, "positives": 10,
                     "negatives": negatives if group == "non-contrast" else 10, "delta": delta,
                     "ci_low": delta - 0.05, "ci_high": delta + 0.05, "significant": group in significant,
                     "significant_holm": False})
    return pd.DataFrame(rows)


def test_the_summary_counts_each_studys_direction_and_significance():
    tables = [
        comparison("run-a", 0, {"venous": -0.06, "arterial": -0.09, "non-contrast": +0.15}, significant=("venous", "non-contrast")),
        comparison("run-b", 1, {"venous": -0.03, "arterial": +0.05, "non-contrast": -0.03}),
        comparison("run-c", 2, {"venous": -0.02, "arterial": +0.12, "non-contrast": -0.04}, significant=("arterial",)),
    ]
    table = replicate_table(tables, "fixed", ("auc",)).set_index("group")
    assert table.loc["venous", "mean_delta"] == pytest.approx(-0.11 / 3)
    assert (table.loc["venous", "min_delta"], table.loc["venous", "max_delta"]) == (-0.06, -0.02)
    assert bool(table.loc["venous", "same_sign"]) and not bool(table.loc["non-contrast", "same_sign"])
    assert (table.loc["venous", "significant_up"], table.loc["venous", "significant_down"]) == (0, 1)
    assert (table.loc["non-contrast", "significant_up"], table.loc["non-contrast", "significant_down"]) == (1, 0)
    assert (table.loc["arterial", "significant_up"], table.loc["arterial", "significant_down"]) == (1, 0)
    assert list(table.loc["arterial", ["seed 0 r 0.3", "seed 1 r 0.3", "seed 2 r 0.3"]]) == [-0.09, 0.05, 0.12]
    assert table.loc["non-contrast", "seed 0 r 0.3 ci"] == "[+0.100, +0.200]*"
    # The comparison table's marks: "~" where the CI excludes 0 but the study did not call it significant.
    assert table.loc["arterial", "seed 0 r 0.3 ci"] == "[-0.140, -0.040]~"
    text = format_replicates(table.reset_index())
    assert "phase:non-contrast" in text and "+0.150 [+0.100, +0.200]*" in text and "1/0" in text


def test_an_empty_significance_cell_is_not_read_as_significant():
    a = comparison("run-a", 0, {"venous": -0.06})
    b = comparison("run-b", 1, {"venous": -0.02}).astype({"significant": object, "significant_holm": object})
    b.loc[0, ["significant", "significant_holm"]] = [float("nan"), float("nan")]
    table = replicate_table([a, b], "fixed", ("auc",))
    assert table.loc[0, "significant_down"] == 0 and table.loc[0, "seed 1 r 0.3 ci"] == "[-0.070, +0.030]"


def test_studies_on_different_sets_or_too_few_are_refused():
    a = comparison("run-a", 0, {"venous": -0.06, "non-contrast": 0.1})
    with pytest.raises(ReplicateError, match="another set.*phase / non-contrast / auc"):
        replicate_table([a, comparison("run-b", 1, {"venous": -0.06, "non-contrast": 0.1}, negatives=13)])
    with pytest.raises(ReplicateError, match="same subgroups.*arterial"):
        replicate_table([a, comparison("run-b", 1, {"venous": -0.06, "non-contrast": 0.1, "arterial": 0.0})])
    with pytest.raises(ReplicateError, match="at least two"):
        replicate_table([a])
    with pytest.raises(ReplicateError, match="operating point must be one of"):
        replicate_table([a, a], "youden")


def test_two_studies_with_one_seed_get_distinct_columns():
    a = comparison("aaaaaaaa1", 0, {"venous": -0.06})
    b = comparison("bbbbbbbb2", 0, {"venous": +0.01})
    table = replicate_table([a, b], "fixed", ("auc",))
    assert {"seed 0 r 0.3 (aaaaaaaa)", "seed 0 r 0.3 (bbbbbbbb)"} <= set(table.columns)


def test_a_finished_study_is_read_with_its_seed_and_ratio(finished_study, tmp_path, capsys, monkeypatch):
    from mlflow.tracking import MlflowClient

    from synthx.commands.replicates import main

    settings, uri, parent_id = finished_study
    client = MlflowClient(uri)
    parent = client.get_run(parent_id)
    augmented = client.get_run(parent.data.tags["step.augmented"])
    table = study_comparison(parent_id, uri)
    assert set(table["study"]) == {parent_id}
    assert set(table["seed"]) == {augmented.data.params["seed"]}
    assert set(table["ratio"]) == {augmented.data.tags["synthx_ratio"]} == {str(settings.ratio)}

    out = tmp_path / "replicates.csv"
    # As `mlflow run -e replicates -P runs="A B"` passes them: one argument holding both ids.
    assert main([f"{parent_id} {parent_id}", "--tracking-uri", uri, "--metric", "sensitivity", "--out", str(out)]) == 0
    lined = pd.read_csv(out)
    own = table[(table["operating_point"] == "fixed") & (table["metric"] == "sensitivity")]
    assert len(lined) == len(own) > 0
    merged = lined.merge(own, on=["attribute", "group", "metric"])
    column = [c for c in lined.columns if c.startswith("seed ") and not c.endswith(" ci")][0]
    defined = merged["delta"].notna()
    assert (merged.loc[defined, column] == merged.loc[defined, "delta"]).all()
    assert (merged.loc[defined, "mean_delta"] == merged.loc[defined, "delta"]).all()
    assert "studies at the fixed operating point" in capsys.readouterr().out
    # Under `mlflow run`, the table also goes on the run it opened.
    holder = client.create_run(client.get_experiment_by_name(settings.experiment).experiment_id).info.run_id
    monkeypatch.setenv("MLFLOW_RUN_ID", holder)
    assert main([parent_id, parent_id, "--tracking-uri", uri, "--metric", "sensitivity"]) == 0
    logged = Path(client.download_artifacts(holder, "replicates/replicates.csv", str(tmp_path / "logged")))
    assert pd.read_csv(logged).equals(lined)
    assert client.get_run(holder).data.tags["replicated_studies"] == f"{parent_id} {parent_id}"

    with pytest.raises(ReplicateError, match="names no study steps"):
        study_comparison(parent.data.tags["step.baseline"], uri)
