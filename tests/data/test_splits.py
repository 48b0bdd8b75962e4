"""Patient-disjoint splits: grouping, stratification, write-once, and the checks of load_split.

Run: OMP_NUM_THREADS=1 .venv/bin/pytest tests/data/test_splits.py -x -q
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from lightning_modules.cli import EXIT_USAGE
from lightning_modules.cli import main as benchx
from lightning_modules.commands.make_splits import main
from lightning_modules.data.cohort import load_cohort, write_case, write_metadata
from lightning_modules.data.metadata import normalize_metadata
from lightning_modules.data.splits import (
    SplitError,
    SplitExistsError,
    SplitSettingError,
    load_split,
    make_splits,
    patient_overlaps,
    split_sha256,
    write_split,
)

PHASES = ["venous"] * 6 + ["arterial"] * 2 + ["non-contrast", "delayed"]


def synthetic_metadata(n_patients: int = 200, seed: int = 1) -> pd.DataFrame:
    """Patients with 1-3 scans, ~30% tumor, a skewed phase mix, and a few synthetic rows."""
    rng = np.random.default_rng(seed)
    rows = []
    for p in range(n_patients):
        tumor = int(rng.random() < 0.3)
        for s in range(int(rng.choice([1, 1, 2, 3]))):
            rows.append(
                {
                    "case_id": f"P{p:04d}_{s}",
                    "patient_id": f"P{p:04d}",
                    "tumor": str(tumor),
                    "phase": PHASES[rng.integers(len(PHASES))],
                    "synthetic": "0",
                }
            )
    rows += [
        {
            "case_id": f"SYN{i}",
            "patient_id": f"SYN{i}",
            "tumor": "1",
            "phase": "venous",
            "synthetic": "1",
            "source_case_id": "P0000_0",
        }
        for i in range(5)
    ]
    table, problems = normalize_metadata(pd.DataFrame(rows).fillna(""))
    assert problems == []
    return table


def test_patients_grouped_and_strata_balanced():
    metadata = synthetic_metadata()
    table = make_splits(metadata, seed=0, val_fraction=0.1, test_fraction=0.2)
    real = metadata[metadata["synthetic"] == 0]
    assert list(table.columns) == ["case_id", "patient_id", "split"]
    assert list(table["case_id"]) == list(real["case_id"])  # synthetic rows are never split
    assert patient_overlaps(table) == {}
    assert table.groupby("patient_id")["split"].nunique().max() == 1

    shares = table["split"].value_counts(normalize=True)
    assert shares["train"] == pytest.approx(0.7, abs=0.03)
    assert shares["val"] == pytest.approx(0.1, abs=0.03)
    assert shares["test"] == pytest.approx(0.2, abs=0.03)
    patient_shares = table.drop_duplicates("patient_id")["split"].value_counts(normalize=True)
    assert patient_shares["val"] == pytest.approx(0.1, abs=0.03)
    assert patient_shares["test"] == pytest.approx(0.2, abs=0.03)
    joined = table.merge(real[["case_id", "tumor", "phase"]], on="case_id")
    overall_positive = (joined["tumor"] == 1).mean()
    for split in ("train", "val", "test"):
        part = joined[joined["split"] == split]
        assert (part["tumor"] == 1).mean() == pytest.approx(overall_positive, abs=0.05)
        assert (part["phase"] == "venous").mean() == pytest.approx((joined["phase"] == "venous").mean(), abs=0.08)
    # Rare phases reach the evaluation splits too.
    assert (joined.loc[joined["split"] == "test", "phase"] == "non-contrast").any()


def test_same_seed_same_split_other_seed_differs():
    metadata = synthetic_metadata(60)
    first = make_splits(metadata, seed=3)
    assert first.equals(make_splits(metadata, seed=3))
    assert not first["split"].equals(make_splits(metadata, seed=4)["split"])


def test_tiny_cohort_fills_every_split():
    metadata, _ = normalize_metadata(pd.DataFrame({"case_id": list("abcde"), "tumor": ["1", "0", "0", "1", "0"]}))
    table = make_splits(metadata, seed=0)
    assert set(table["split"]) == {"train", "val", "test"}
    with pytest.raises(SplitSettingError, match="cannot fill"):
        make_splits(metadata.iloc[:2], seed=0)


def test_write_once_and_sha(tmp_path):
    table = make_splits(synthetic_metadata(30), seed=0)
    path = tmp_path / "splits" / "x.csv"
    write_split(table, path)
    digest = split_sha256(path)
    assert len(digest) == 64
    with pytest.raises(SplitExistsError, match="written once"):
        write_split(table, path)
    write_split(make_splits(synthetic_metadata(30), seed=5), path, force=True)
    assert split_sha256(path) != digest
    assert load_split(path).equals(pd.read_csv(path, dtype=str, keep_default_na=False))


def test_patient_in_two_splits_is_a_hard_failure(tmp_path):
    bad = pd.DataFrame(
        {
            "case_id": ["a", "b", "c", "d"],
            "patient_id": ["P1", "P1", "P2", "P3"],
            "split": ["train", "test", "train", "val"],
        }
    )
    with pytest.raises(SplitError) as caught:
        write_split(bad, tmp_path / "bad.csv")
    assert not (tmp_path / "bad.csv").exists()
    bad.to_csv(tmp_path / "bad.csv", index=False)
    with pytest.raises(SplitError) as caught:
        load_split(tmp_path / "bad.csv")
    [problem] = caught.value.problems
    assert problem.case_id == "P1" and "['test', 'train']" in problem.message
    assert "a (train)" in problem.message and "b (test)" in problem.message


def test_structural_problems_are_all_listed(tmp_path):
    path = tmp_path / "s.csv"
    pd.DataFrame(
        {
            "case_id": ["a", "a", "b", ""],
            "patient_id": ["1", "1", "2", "3"],
            "split": ["train", "train", "holdout", "val"],
        }
    ).to_csv(path, index=False)
    with pytest.raises(SplitError) as caught:
        load_split(path)
    messages = [str(p) for p in caught.value.problems]
    assert any("a:" in m and "more than once" in m for m in messages)
    assert any("b:" in m and "'holdout'" in m for m in messages)
    assert any("empty case id" in m for m in messages)
    pd.DataFrame({"case_id": ["a"], "split": ["train"]}).to_csv(path, index=False)
    with pytest.raises(SplitError, match="patient_id"):
        load_split(path)
    with pytest.raises(SplitError, match="does not exist"):
        load_split(tmp_path / "absent.csv")


def _tiny_cohort(root):
    shape, affine = (6, 6, 6), np.eye(4)
    root.mkdir(parents=True)
    rows = []
    for i in range(10):
        lesion = np.zeros(shape, np.uint8)
        lesion[2:4, 2:4, 2:4] = i % 3 == 0
        write_case(root, f"C{i}", np.zeros(shape), affine, {"pancreas": np.ones(shape), "pancreatic_lesion": lesion})
        # tumor left empty: make-splits derives it from the lesion mask
        rows.append({"case_id": f"C{i}", "patient_id": f"P{i // 2}", "phase": "venous", "tumor": "", "synthetic": 0})
    rows.append(
        {"case_id": "S0", "patient_id": "S0", "phase": "venous", "tumor": 1, "synthetic": 1, "source_case_id": "C0"}
    )
    write_metadata(root, pd.DataFrame(rows).fillna(""))
    return root


def test_cohort_checks_unknown_case_and_patient_mismatch(tmp_path):
    root = _tiny_cohort(tmp_path / "cohort")
    cohort = load_cohort(root)
    path = tmp_path / "s.csv"
    pd.DataFrame(
        {
            "case_id": ["C0", "C1", "C2", "GHOST", "S0"],
            "patient_id": ["P0", "P0", "P9", "PX", "S0"],
            "split": ["train", "train", "val", "test", "test"],
        }
    ).to_csv(path, index=False)
    with pytest.raises(SplitError) as caught:
        load_split(path, cohort)
    messages = [str(p) for p in caught.value.problems]
    assert any(m.startswith("GHOST:") and "not in cohort" in m for m in messages)
    assert any(m.startswith("C2:") and "'P9' disagrees with the cohort metadata ('P1')" in m for m in messages)
    assert any(m.startswith("S0:") and "synthetic" in m for m in messages)


def test_make_splits_command(tmp_path, capsys):
    root = _tiny_cohort(tmp_path / "cohort")
    out = tmp_path / "splits" / "tiny.csv"
    assert main(["--root", str(root), "--out", str(out), "--seed", "0", "--val", "0.2", "--test", "0.2"]) == 0
    printed = capsys.readouterr().out
    assert "positives" in printed and "phase:venous" in printed and "1 synthetic case(s) left out" in printed
    table = load_split(out, load_cohort(root))
    assert len(table) == 10 and "S0" not in set(table["case_id"])
    assert patient_overlaps(table) == {}
    before = out.read_bytes()
    # A fixable refusal is a short message with the usage exit code, through the benchx dispatcher.
    assert benchx(["make-splits", "--root", str(root), "--out", str(out)]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "already exists" in err and "--force" in err and "Traceback" not in err
    assert out.read_bytes() == before


@pytest.mark.parametrize(
    ("val", "test", "message"),
    [("0.6", "0.6", "val + test <= 1"), ("-0.1", "0.2", "in [0, 1]"), ("nan", "0.2", "in [0, 1]")],
)
def test_make_splits_refuses_fractions_with_exit_2(tmp_path, capsys, val, test, message):
    root = _tiny_cohort(tmp_path / "cohort")
    out = tmp_path / "split.csv"
    assert benchx(["make-splits", "--root", str(root), "--out", str(out), "--val", val, "--test", test]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.startswith("benchx make-splits: ") and message in err and "Traceback" not in err
    assert not out.exists()


def test_make_splits_refuses_a_missing_cohort_with_exit_2(tmp_path, capsys):
    out = tmp_path / "split.csv"
    assert benchx(["make-splits", "--root", str(tmp_path / "nowhere"), "--out", str(out)]) == EXIT_USAGE
    assert "Traceback" not in capsys.readouterr().err and not out.exists()


@pytest.mark.parametrize(("val", "test"), [("0.1", "0.9"), ("0.7", "0.3"), ("0", "1")])
def test_an_external_cohort_may_have_no_training_share(tmp_path, capsys, val, test):
    root = _tiny_cohort(tmp_path / "cohort")
    out = tmp_path / "external.csv"
    assert benchx(["make-splits", "--root", str(root), "--out", str(out), "--val", val, "--test", test]) == 0
    table = load_split(out, load_cohort(root))
    counts = table["split"].value_counts()
    assert "train" not in counts and counts.sum() == 10
    assert counts.get("test", 0) >= 1 and (counts.get("val", 0) >= 1) == (float(val) > 0)
    # The larger share gets the larger split.
    assert (counts.get("test", 0) > counts.get("val", 0)) == (float(test) > float(val))


def test_the_one_reader_reads_leniently_for_the_audit(tmp_path):
    path = tmp_path / "split.csv"
    path.write_text("case_id,split\n C1 ,train\nC1,test\nC2,holdout\n")
    # check=True lists every problem; check=False returns the trimmed table for tools that report them.
    with pytest.raises(SplitError) as caught:
        load_split(path)
    assert "patient_id" in str(caught.value)
    table = load_split(path, check=False)
    assert list(table["case_id"]) == ["C1", "C1", "C2"] and list(table.columns) == ["case_id", "split"]
    path.write_text("case,split\nC1,train\n")
    with pytest.raises(SplitError, match=r"required column\(s\) \['case_id'\] missing"):
        load_split(path, check=False)
