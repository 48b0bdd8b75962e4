"""A ``metadata.csv`` that is empty, ragged or not UTF-8 is named by every command that reads it
(validate, make-splits, predict --input <cohort>, train): one short message, no pandas traceback."""

from __future__ import annotations

import shutil

import pytest

from conftest import RECIPES, tiny_overrides
from lightning_modules.cli import EXIT_USAGE, main
from lightning_modules.data.metadata import MetadataReadError, read_metadata_csv

BROKEN = {
    "empty": (b"", "the file is empty"),
    "ragged": (None, "ragged table, every row needs the header's number of fields"),
    "latin1": (None, "not UTF-8 text (byte 0xe9"),
}


def broken_cohort(tiny_phantom, tmp_path, kind: str):
    root, split = tiny_phantom
    cohort = tmp_path / "cohort"
    shutil.copytree(root, cohort)
    metadata = cohort / "metadata.csv"
    text = metadata.read_bytes()
    if kind == "empty":
        metadata.write_bytes(b"")
    elif kind == "ragged":
        lines = text.splitlines()
        metadata.write_bytes(b"\n".join([*lines[:3], lines[3] + b",extra,fields", *lines[4:]]) + b"\n")
    else:
        lines = text.decode().splitlines()
        lines[2] += "é"  # a Latin-1 byte in a cell
        metadata.write_bytes("\n".join(lines).encode("latin-1") + b"\n")
    return cohort, split, metadata


@pytest.mark.parametrize("kind", sorted(BROKEN))
def test_the_one_reader_names_the_file_and_the_fault(kind, tiny_phantom, tmp_path):
    _, _, metadata = broken_cohort(tiny_phantom, tmp_path, kind)
    with pytest.raises(MetadataReadError) as error:
        read_metadata_csv(metadata)
    assert error.value.problem.file == str(metadata) and BROKEN[kind][1] in error.value.problem.message


@pytest.mark.parametrize("kind", sorted(BROKEN))
def test_every_command_reading_the_metadata_names_it_with_a_short_message(kind, tiny_phantom, tmp_path, capsys):
    cohort, split, metadata = broken_cohort(tiny_phantom, tmp_path, kind)
    expected = f"{metadata}: cannot read metadata: {BROKEN[kind][1]}"

    assert main(["validate", "--root", str(cohort)]) == 1
    assert expected in capsys.readouterr().out

    out = tmp_path / "split.csv"
    assert main(["make-splits", "--root", str(cohort), "--out", str(out)]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert expected in err and "Traceback" not in err and not out.exists()

    predictions = tmp_path / "predictions"
    assert main(["predict", "--checkpoint", str(tmp_path / "none.ckpt"), "--recipe", str(RECIPES / "unet.yaml"),
                 "--input", str(cohort), "--out", str(predictions)]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert expected in err and "Traceback" not in err and not predictions.exists()

    assert main(["train", "--recipe", str(RECIPES / "unet.yaml"), *tiny_overrides(cohort, split, tmp_path)]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert expected in err and "Traceback" not in err
    assert not list(tmp_path.rglob("*.ckpt"))
