"""Several finished studies side by side (``benchx replicates``): the summary across studies is
computed from each study's own comparison rows, and studies that cannot be lined up are refused."""

from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tiny_study import finished_study  # noqa: E402,F401  (fixture)

from synthx.workflows.replicates import ReplicateError, format_replicates, replicate_table, study_comparison  # noqa: E402


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


def study_arguments(settings) -> list[str]:
    """The ``benchx study`` command line of a study's settings (the tiny study of test_synthx_study.py)."""
    arguments = ["--recipe", settings.recipe, "--profile", settings.profile, "--synthx-recipe", settings.synthx_recipe,
                 "--ratio", str(settings.ratio), "--target", settings.target, "--painter", settings.painter,
                 "--locked-cases", str(settings.locked_cases), "--experiment", settings.experiment,
                 "--out", settings.output_dir]
    optional = {"--budget": settings.budget, "--synthesis-steps": settings.synthesis_steps, "--cases": settings.cases,
                "--locked-seed": settings.locked_seed,
                "--target-phases": ",".join(settings.target_phases) if settings.target_phases else None}
    for option, value in optional.items():
        if value is not None:
            arguments += [option, str(value)]
    for override in settings.synthx_overrides:
        arguments += ["--synthx-override", override]
    return [*arguments, *settings.overrides]


def test_a_replicate_s_command_line_carries_every_setting_of_its_study(tmp_path):
    """A Slurm task parses the study from its command line: the same settings, so the same replicate set."""
    from dataclasses import replace

    from lightning_modules.commands.common import parse_command_line
    from synthx.commands.study import build_parser, study_settings
    from synthx.workflows.replicates import replicate_key
    from test_synthx_study import _study_settings

    settings = replace(_study_settings(tmp_path / "cohort", tmp_path / "split.csv", tmp_path),
                       target_phases=["arterial"], locked_seed=77)
    parsed = study_settings(parse_command_line(build_parser(), study_arguments(settings)))
    assert parsed == settings
    assert replicate_key(parsed, "c0de") == replicate_key(settings, "c0de")
    assert replicate_key(replace(parsed, locked_cases=307), "c0de") != replicate_key(settings, "c0de")


@pytest.mark.slow  # three or more minutes on 2 cores: the Slurm array test in tests/services covers the same in CI
def test_two_replicates_run_as_two_workers_and_are_pooled(tiny_phantom, tmp_path, capsys):
    """``benchx study --seeds 2 --workers 2``: two processes, one per seed, into one store; pooled;
    a second run keeps both; a replicate whose process was killed is resumed, not redone."""
    from mlflow.tracking import MlflowClient

    from conftest import RECIPES
    from synthx.commands.study import main
    from synthx.workflows.replicates import REPLICATE_SEED_TAG, finished_replicates, replicate_key
    from test_synthx_study import _study_settings

    from lightning_modules.infrastructure.process import git_commit
    from lightning_modules.tracking import experiment_id

    root, split = tiny_phantom
    settings = _study_settings(root, split, tmp_path)
    settings.synthx_recipe = str(RECIPES / "generator" / "synthx.yaml")
    settings.experiment = "seeds-test"
    arguments = study_arguments(settings)
    assert main([*arguments, "--seeds", "2", "--workers", "2"]) == 0
    out = capsys.readouterr().out
    assert "seed 0: started" in out and "seed 1: started" in out

    uri = [o for o in settings.overrides if o.startswith("tracking.uri=")][0].split("=", 1)[1]
    client = MlflowClient(uri)
    experiment = experiment_id("seeds-test", uri)
    replicates = finished_replicates(client, experiment, replicate_key(settings, git_commit()))
    assert sorted(replicates) == [0, 1]
    trainings = {}
    for seed, parent in replicates.items():
        assert parent.data.tags[REPLICATE_SEED_TAG] == str(seed)
        baseline = client.get_run(parent.data.tags["step.baseline"])
        assert baseline.data.params["seed"] == str(seed)
        trainings[seed] = baseline.info.run_id
        log = (Path(settings.output_dir) / f"seed-{seed}.log").read_text()
        assert "[study] baseline: done" in log
    assert trainings[0] != trainings[1]

    pooled_runs = client.search_runs([experiment], "tags.stage = 'replicates_pooled'")
    assert len(pooled_runs) == 1
    table = pd.read_csv(client.download_artifacts(pooled_runs[0].info.run_id, "pooled/test_subgroup_matched_specificity.csv",
                                                  str(tmp_path / "pooled")))
    # The pairs the study compared; and the decomposition pooled, since every replicate has the copy-paste arm.
    assert set(table["comparison"]) == {"synthx - sham", "copy_paste - sham", "baseline - sham"}
    parts = pd.read_csv(client.download_artifacts(pooled_runs[0].info.run_id, "pooled/decomposition_test_subgroup_matched_specificity.csv",
                                                  str(tmp_path / "parts")))
    assert list(dict.fromkeys(parts["component"])) == ["placement", "content", "total"]
    assert set(parts.loc[parts["attribute"] == "overall", "seeds"]) == {2}
    overall = table[(table["attribute"] == "overall") & (table["metric"] == "specificity")].iloc[0]
    assert overall["seeds"] == 2 and overall["mean_delta"] == pytest.approx((overall["delta 0"] + overall["delta 1"]) / 2)
    assert "seeds pooled at the subgroup_matched_specificity operating point" in out

    # A second run starts nothing: both replicates have finished.
    assert main([*arguments, "--seeds", "2", "--workers", "2"]) == 0
    again = capsys.readouterr().out
    assert "started" not in again and again.count("finished replicate") == 2
    # A replicate whose process was killed (its parent run never ended) is resumed: every step it
    # had finished is reused, nothing is trained again.
    client.set_terminated(replicates[1].info.run_id, "KILLED")
    logged = len((Path(settings.output_dir) / "seed-1.log").read_text())
    assert main([*arguments, "--seeds", "2", "--workers", "2"]) == 0
    resumed = capsys.readouterr().out
    assert "seed 1: started" in resumed and "seed 0: started" not in resumed
    log = (Path(settings.output_dir) / "seed-1.log").read_text()[logged:]
    assert "[study] baseline: identical finished run" in log and "[study] augmented: identical finished run" in log
    assert "done in" not in log, "a resumed replicate reruns none of its finished steps"


def test_a_replicate_is_the_study_seeded_in_its_own_folder(capsys):
    from synthx.commands.study import main, replicate_command
    from synthx.workflows.replicates import replicate_key, seeded_settings
    from synthx.workflows.study.settings import StudySettings

    settings = StudySettings(overrides=["trainer.max_steps=4"], synthx_overrides=["trainer.max_steps=2"], output_dir="out/s")
    seeded = seeded_settings(settings, 3)
    assert seeded.overrides == ["trainer.max_steps=4", "seed=3"] and seeded.synthx_overrides == ["trainer.max_steps=2", "seed=3"]
    assert seeded.output_dir == str(Path("out/s") / "seed-3") and settings.overrides == ["trainer.max_steps=4"]
    control = seeded_settings(StudySettings(painter="phantom"), 1)
    assert control.synthx_overrides == [] and control.overrides == ["seed=1"]  # no generator to seed
    # The set's identity: the settings and code, not the output folder; another ratio is another set.
    key = replicate_key(settings, "abc")
    assert key == replicate_key(StudySettings(**{**settings.__dict__, "output_dir": "elsewhere"}), "abc")
    assert key != replicate_key(StudySettings(**{**settings.__dict__, "ratio": 0.5}), "abc") != replicate_key(settings, "abd")

    command = replicate_command(["--recipe", "r.yaml", "--seeds", "3", "--workers=2", "--pool-only", "--operating-point",
                                 "fixed", "seed=4"])
    assert command[1:] == ["-m", "lightning_modules.cli", "study", "--recipe", "r.yaml", "seed=4"]
    for arguments, message in ((["--seeds", "2", "--seed", "1"], "not both"), (["--pool-only"], "needs --seeds"),
                               (["--seeds", "1"], "argument --seeds: must be an integer >= 2, got 1")):
        with pytest.raises(SystemExit):
            main(arguments)
        assert message in capsys.readouterr().err


def test_with_a_locked_cohort_the_baseline_arm_is_its_locked_evaluation(monkeypatch, tmp_path):
    """The pooled analysis pairs arms on one evaluation set: the baseline's locked-cohort evaluation,
    not its development test split (which the sham and SynthX arms were never evaluated on)."""
    from types import SimpleNamespace

    import synthx.workflows.replicates as replicates
    from synthx.workflows.replicates import replicate_arms

    tags = {"step.evaluate_baseline": "dev", "step.evaluate_locked_baseline": "locked", "step.evaluate_sham": "sham",
            "step.evaluate_synthx": "synthx", "step.baseline": "train"}
    parent = SimpleNamespace(info=SimpleNamespace(run_id="parent"), data=SimpleNamespace(tags=tags))
    from lightning_modules.workflows.evaluate import OPERATING_POINT_METRIC

    metrics = SimpleNamespace(data=SimpleNamespace(metrics={OPERATING_POINT_METRIC.format(name="val_chosen"): 100.0}))
    client = SimpleNamespace(get_run=lambda run_id: metrics)
    monkeypatch.setattr(replicates, "download_records",
                        lambda client, run_id, stage, folder: pd.DataFrame({"case_id": [run_id]}))
    arms = replicate_arms(client, parent, "test", "val_chosen", str(tmp_path))
    assert {arm: list(value.records["case_id"]) for arm, value in arms.items()} == {
        "baseline": ["locked"], "sham": ["sham"], "synthx": ["synthx"]}


def test_worker_processes_share_the_cpus_in_threads(tmp_path, monkeypatch, capsys):
    """``--workers N`` gives each replicate process CPUs // N threads (at least 1), unless the user set them."""
    import subprocess
    from dataclasses import replace

    from synthx.workflows.replicates import run_replicates, worker_threads
    from test_synthx_study import _study_settings

    assert [worker_threads(w, cpus=2) for w in (1, 2, 3)] == [2, 1, 1]
    assert worker_threads(4, cpus=16) == 4
    started = []
    real_popen = subprocess.Popen

    class Finished:
        returncode = 0

        def __init__(self, command, env, **_):
            started.append((command[-1], env["OMP_NUM_THREADS"], env["MKL_NUM_THREADS"]))

        def poll(self):
            return 0

    def popen(command, *args, **kwargs):  # the replicate processes are recorded; git and others run
        return Finished(command, **kwargs) if command[0] == "benchx" else real_popen(command, *args, **kwargs)

    monkeypatch.setattr(subprocess, "Popen", popen)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    settings = replace(_study_settings(tmp_path / "cohort", tmp_path / "split.csv", tmp_path), experiment="threads")
    run_replicates(settings, [0, 1], 2, ["benchx", "study"])
    share = str(worker_threads(2))
    assert sorted(started) == [("0", share, share), ("1", share, share)]
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    started.clear()
    run_replicates(replace(settings, output_dir=str(tmp_path / "again")), [0], 2, ["benchx", "study"])
    assert started[0][1] == "3", "a user's own setting is kept"


@pytest.mark.parametrize("point", ["subgroup_matched_specificity", "matched_specificity", "val_chosen"])
def test_pooling_identical_seeds_reproduces_the_studys_own_comparison(finished_study, tmp_path, point):
    """Two seeds that are one study: every pooled mean is that study's own paired difference at the
    same operating point, so the pooled analysis uses the m the study's comparison used (at matched
    specificity the arm's m matched to the reference's validation specificity)."""
    from mlflow.tracking import MlflowClient

    from synthx.workflows.replicates import pooled_table
    from synthx.workflows.report.runs import COMPARISON_ARTIFACT, load_study

    settings, uri, parent_id = finished_study
    client = MlflowClient(uri)
    parent = client.get_run(parent_id)
    table = pooled_table(client, {"0": parent, "1": parent}, point, n_resamples=20)
    own = load_study(parent_id, uri, tmp_path / "study").csv("compare", COMPARISON_ARTIFACT)
    own = own[(own["operating_point"] == point) & own["metric"].isin(["sensitivity", "specificity"])]
    assert {"synthx - sham", "baseline - sham"} <= set(table["comparison"])
    checked = 0
    for r in own.itertuples(index=False):
        row = table[(table["comparison"] == f"{r.run} - {r.reference}") & (table["metric"] == r.metric)
                    & (table["attribute"] == r.attribute) & (table["group"].astype(str) == str(r.group))]
        if row.empty or pd.isna(r.delta):
            continue
        assert row["mean_delta"].iloc[0] == pytest.approx(r.delta, abs=1e-12), (r.run, r.attribute, r.group, r.metric)
        checked += 1
    assert checked >= 10


def test_the_pooled_page_names_its_runs_and_judges_the_pooled_difference(finished_study, tmp_path):
    """``benchx report --run-id <pooled run> --markdown``: docs/seeds.md from a pooled run, its figures
    read from the pooled table (two seeds that are the same study: each seed's own line is that
    study's primary endpoint sentence)."""
    from mlflow.tracking import MlflowClient

    from synthx.commands.report import main
    from synthx.workflows.pooled_page import pooled_markdown
    from synthx.workflows.replicates import POOLED_STAGE, pooled_table
    from synthx.workflows.report.runs import load_study, verdict_lines

    settings, uri, parent_id = finished_study
    client = MlflowClient(uri)
    parent = client.get_run(parent_id)
    pages = {}
    for point in ("subgroup_matched_specificity", "val_chosen"):
        table = pooled_table(client, {"3": parent, "4": parent}, point, n_resamples=50)
        pooled = client.create_run(parent.info.experiment_id, run_name="pooled", tags={
            "stage": POOLED_STAGE, "operating_point": point, "replicated_studies": f"{parent_id} {parent_id}"})
        client.log_param(pooled.info.run_id, "seeds", "3,4")
        client.log_text(pooled.info.run_id, table.to_csv(index=False), f"pooled/test_{point}.csv")
        client.set_terminated(pooled.info.run_id, "FINISHED")
        out = tmp_path / point / "seeds.md"
        assert main(["--run-id", pooled.info.run_id, "--markdown", str(out), "--tracking-uri", uri]) == 0
        pages[point] = (out.read_text(), table, pooled.info.run_id)

    page, table, run_id = pages["subgroup_matched_specificity"]
    assert page.startswith("# Seeds pooled") and f"`{run_id}`" in page
    assert parent.data.tags["git_commit"] in page and "seeds 3, 4" in page
    primary = next(line for line in verdict_lines(load_study(parent_id, uri, tmp_path / "study"))
                   if line.startswith("Primary endpoint"))
    assert page.count(primary) == 2 and f"- Seed 3 (study run `{parent_id}`): {primary}" in page
    arterial = table[(table["comparison"] == "synthx - sham") & (table["metric"] == "sensitivity")
                     & (table["group"] == "arterial")].iloc[0]
    pooled_line = (f"- Primary endpoint (sensitivity in arterial, SynthX - sham): SynthX - sham "
                   f"{100 * arterial['mean_delta']:+.1f} percentage points on average over 2 seeds")
    assert pooled_line in page
    assert "- Scarcity gap (arterial)" not in page, "the endpoint's subgroup is judged once"
    assert "- Physics gap (non-contrast): SynthX - sham" in page
    assert "| SynthX - sham | Phase: arterial |" in page and "| baseline - sham | All scans |" in page
    # Each pooled difference carries its mark from Holm over its family, as a single study's tables do.
    from synthx.analysis.endpoint import family_marks, PrimaryEndpoint

    marks = family_marks(table.assign(run=table["arm"], operating_point="subgroup_matched_specificity", delta=table["mean_delta"]),
                         PrimaryEndpoint())
    shown = table[(table["metric"] == "sensitivity") & table["attribute"].isin(["overall", "phase"])]
    def points(value) -> str:
        return "-" if pd.isna(value) else f"{100 * value:+.1f}"

    for index, r in shown.iterrows():
        cell = f"{points(r['mean_delta'])} [{points(r['ci_low'])}, {points(r['ci_high'])}] {marks[index]}"
        assert f"| {cell.rstrip()} |" in page, cell
    # Another point than the endpoint's: the page says the endpoint is not judged there.
    other = pages["val_chosen"][0]
    assert "Primary endpoint (sensitivity" not in other.split("## Primary endpoint, replicate by replicate")[0]
    assert "pool with --operating-point subgroup_matched_specificity for the endpoint" in other
    with pytest.raises(ValueError, match="not a pooled analysis"):
        pooled_markdown(parent_id, uri)
    # A README's seeds block gets the pooled verdict only; the rest of the README is kept.
    readme = tmp_path / "README.md"
    readme.write_text("# Title\n\n<!-- benchx-seeds:start -->\nold\n<!-- benchx-seeds:end -->\n\n## After\n")
    assert main(["--run-id", run_id, "--markdown", str(readme), "--tracking-uri", uri]) == 0
    text = readme.read_text()
    assert text.startswith("# Title\n\n<!-- benchx-seeds:start -->\nGenerated by") and text.endswith("<!-- benchx-seeds:end -->\n\n## After\n")
    assert pooled_line in text and "**Pooled verdict" in text and "old" not in text and "Seed 3 (study run" not in text


def test_pooling_identical_seeds_reproduces_the_studys_own_decomposition(finished_study, tmp_path):
    """Two seeds that are one study: each pooled component is that study's own decomposition (its
    pairs at the m the study used), the pooled page shows it, and replicates without the copy-paste
    arm give no pooled decomposition."""
    from types import SimpleNamespace

    from mlflow.tracking import MlflowClient

    from synthx.workflows.pooled_decomposition import POOLED_ARTIFACT, pooled_decomposition_table, SECTION
    from synthx.workflows.pooled_page import pooled_markdown
    from synthx.workflows.replicates import POOLED_STAGE, pooled_table, replicate_arms

    settings, uri, parent_id = finished_study
    client = MlflowClient(uri)
    parent = client.get_run(parent_id)
    point = "subgroup_matched_specificity"  # the endpoint's, where the study made its decomposition
    table = pooled_decomposition_table(client, {"0": parent, "1": parent}, point, replicate_arms, n_resamples=20)
    own = pd.read_csv(client.download_artifacts(parent_id, "synthx/decomposition.csv", str(tmp_path / "own")))
    assert list(dict.fromkeys(table["component"])) == ["placement", "content", "total"]
    for r in own.itertuples(index=False):
        row = table[(table["component"] == r.component) & (table["attribute"] == r.attribute)
                    & (table["group"].astype(str) == str(r.group))]
        # A subgroup without a tumor scan in the locked cohort has no difference, pooled or not.
        assert row["mean_delta"].iloc[0] == pytest.approx(r.difference, abs=1e-12, nan_ok=True), (r.component, r.group)
        assert row["delta 0"].iloc[0] == pytest.approx(r.difference, abs=1e-12, nan_ok=True)
    assert own["difference"].notna().sum() >= 6
    pooled = client.create_run(parent.info.experiment_id, run_name="pooled", tags={
        "stage": POOLED_STAGE, "operating_point": point, "replicated_studies": f"{parent_id} {parent_id}"})
    client.log_param(pooled.info.run_id, "seeds", "0,1")
    client.log_text(pooled.info.run_id, pooled_table(client, {"0": parent, "1": parent}, point, n_resamples=20).to_csv(index=False),
                    f"pooled/test_{point}.csv")
    client.log_text(pooled.info.run_id, table.to_csv(index=False), POOLED_ARTIFACT.format(stage="test", point=point))
    client.set_terminated(pooled.info.run_id, "FINISHED")
    page = pooled_markdown(pooled.info.run_id, uri)
    section = page.split(SECTION)[1]
    overall = own[(own["component"] == "placement") & (own["attribute"] == "overall")].iloc[0]
    assert f"| placement (canvases and placement) | copy-paste - sham | All scans | {int(overall['positives'])} |" in section
    assert f"{100 * overall['difference']:+.1f}" in section.split("| placement (canvases and placement) | copy-paste - sham | All scans |")[1].split("\n")[0]
    assert "| content (generated content) | SynthX - copy-paste |" in section
    # Replicates without the copy-paste arm (studies of an earlier version, the positive control): none.
    tags = {key: value for key, value in parent.data.tags.items() if key != "step.evaluate_copy_paste"}
    without = SimpleNamespace(info=parent.info, data=SimpleNamespace(tags=tags))
    assert pooled_decomposition_table(client, {"0": without, "1": parent}, point, replicate_arms) is None
