"""docs/benchmarks.md is written from what the benchmark scripts record, never typed by hand.

The scripts here are planted: tiny programs that record a row the way the real benchmarks do
(benchmarks/record.py), so the page's plumbing (fresh processes, ranges over runs, the block, the
refusals) is checked in seconds; the real scripts' figures are the page itself.
"""

from __future__ import annotations

import math
import sys
import textwrap
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from benchmarks import write_page  # noqa: E402
from benchmarks.record import Row, merge_runs, read_rows, record  # noqa: E402

PAGE = "# Benchmarks\n\nProse before.\n\n<!-- benchx-benchmarks:start -->\nold figures\n<!-- benchx-benchmarks:end -->\n\nProse after.\n"


def planted_script(folder: Path, body: str) -> Path:
    """A benchmark that records through benchmarks/record.py; ``body`` runs with ``args`` parsed and a
    run counter ``run`` (1, 2, ...) kept in a file beside it."""
    script = folder / "bench_planted.py"
    script.write_text(textwrap.dedent(f"""
        import argparse, sys
        from pathlib import Path
        sys.path.insert(0, {str(REPO_ROOT)!r})
        from benchmarks.record import Row, add_record_argument, record
        parser = argparse.ArgumentParser()
        add_record_argument(parser)
        args = parser.parse_args()
        counter = Path(__file__).with_suffix(".count")
        run = int(counter.read_text()) + 1 if counter.exists() else 1
        counter.write_text(str(run))
    """) + textwrap.dedent(body))
    return script


def test_rows_survive_the_record_file(tmp_path):
    row = Row(label="a step", script="bench_x.py", figures={"ms": (12.345, ".1f")}, text="{ms} ms/step",
              ratio="", target="<= 13 ms", met=True)
    record(tmp_path / "rows.jsonl", row)
    record(tmp_path / "rows.jsonl", row)
    record(None, row)  # no --record: nothing written anywhere
    assert read_rows(tmp_path / "rows.jsonl") == [row, row]


def test_numpy_scalars_are_recorded_as_plain_values_and_a_failed_row_writes_nothing(tmp_path):
    import numpy as np

    row = Row(label="wait", script="bench_x.py", figures={"share": (np.float64(4.4), ".1f")}, text="{share} %",
              target="<= 5 %", met=np.float64(0.044) <= 0.05)
    record(tmp_path / "rows.jsonl", row)
    assert read_rows(tmp_path / "rows.jsonl") == [row] and read_rows(tmp_path / "rows.jsonl")[0].met is True
    unserializable = Row(label="bad", script="bench_x.py", figures={}, text="")
    unserializable.target = object()  # a value JSON cannot write: nothing of the call may reach the file
    with pytest.raises(TypeError):
        record(tmp_path / "rows.jsonl", row, unserializable)
    assert len(read_rows(tmp_path / "rows.jsonl")) == 1


def test_runs_merge_into_ranges_and_say_how_often_the_target_was_met():
    def run(ms, met):
        return Row(label="step", script="bench_x.py", figures={"ms": (ms, ".1f"), "ratio": (ms / 10, ".2f")},
                   text="{ms} ms/step", ratio="x {ratio}", target="<= 1.05", met=met)

    merged = merge_runs([run(10.04, True), run(10.01, True)])
    assert merged["figures"] == "10.0 ms/step" and merged["ratio"] == "x 1.00" and merged["met"] == "yes"
    merged = merge_runs([run(9.0, True), run(12.0, False), run(11.0, False)])
    assert merged["figures"] == "9.0-12.0 ms/step" and merged["ratio"] == "x 0.90-1.20"
    assert merged["met"] == "on 1 of 3 runs"
    assert merge_runs([run(12.0, False)])["met"] == "no"
    no_target = Row(label="memory", script="bench_x.py", figures={"b": (math.nan, ".1f")}, text="{b} bytes")
    assert merge_runs([no_target])["figures"] == "n/a bytes" and merge_runs([no_target])["met"] == ""


def test_the_page_is_written_from_each_runs_record(tmp_path, monkeypatch, capsys):
    script = planted_script(tmp_path, """
        record(args.record, Row(label="planted step", script="bench_planted.py", figures={"ms": (40.0 + run, ".1f")},
                                text="{ms} ms/step", target="<= 41.5 ms", met=40.0 + run <= 41.5))
        sys.exit(0 if 40.0 + run <= 41.5 else 1)  # a missed target still records its figures
    """)
    page = tmp_path / "benchmarks.md"
    page.write_text(PAGE)
    monkeypatch.setattr(write_page, "measured_commit", lambda root=None: ("ab" * 20, []))
    assert write_page.main(["--runs", "2", "--only", str(script), "--markdown", str(page)]) == 0
    text = page.read_text()
    assert text.startswith("# Benchmarks\n\nProse before.") and text.endswith("Prose after.\n")
    assert "old figures" not in text
    assert f"at commit `{'ab' * 20}`" in text and "each script run 2 time(s)" in text
    assert "| planted step (`bench_planted.py`) | 41.0-42.0 ms/step |  | <= 41.5 ms | on 1 of 2 runs |" in text
    assert "Machine: " in text and " CPUs (" in text


def test_a_crashed_benchmark_leaves_the_page_as_it_was(tmp_path, monkeypatch, capsys):
    script = planted_script(tmp_path, "raise RuntimeError('out of memory')\n")
    page = tmp_path / "benchmarks.md"
    page.write_text(PAGE)
    monkeypatch.setattr(write_page, "measured_commit", lambda root=None: ("ab" * 20, []))
    assert write_page.main(["--runs", "1", "--only", str(script), "--markdown", str(page)]) == 1
    assert "bench_planted.py exited 1 and recorded no figures" in capsys.readouterr().err
    assert page.read_text() == PAGE


def test_runs_that_record_different_rows_are_refused(tmp_path, monkeypatch, capsys):
    script = planted_script(tmp_path, """
        rows = [Row(label="always", script="bench_planted.py", figures={}, text="x")]
        if run == 1:
            rows.append(Row(label="first run only", script="bench_planted.py", figures={}, text="y"))
        record(args.record, *rows)
    """)
    page = tmp_path / "benchmarks.md"
    page.write_text(PAGE)
    monkeypatch.setattr(write_page, "measured_commit", lambda root=None: ("ab" * 20, []))
    assert write_page.main(["--runs", "2", "--only", str(script), "--markdown", str(page)]) == 1
    assert "recorded other rows on other runs" in capsys.readouterr().err
    assert page.read_text() == PAGE


def test_uncommitted_code_or_a_page_without_its_block_is_refused_before_any_run(tmp_path, monkeypatch, capsys):
    script = planted_script(tmp_path, "raise SystemExit('must not run')\n")
    page = tmp_path / "benchmarks.md"
    page.write_text(PAGE)
    monkeypatch.setattr(write_page, "measured_commit", lambda root=None: ("ab" * 20, [" M synthx/model.py"]))
    assert write_page.main(["--only", str(script), "--markdown", str(page)]) == 2
    assert "synthx/model.py" in capsys.readouterr().err and page.read_text() == PAGE
    assert not script.with_suffix(".count").exists(), "a refusal comes before the benchmarks run"

    monkeypatch.setattr(write_page, "measured_commit", lambda root=None: ("ab" * 20, []))
    page.write_text("# Benchmarks\n\nno block\n")
    assert write_page.main(["--only", str(script), "--markdown", str(page)]) == 2
    assert "benchx-benchmarks:start" in capsys.readouterr().err
    page.write_text(PAGE)
    assert write_page.main(["--only", "bench_nothing.py", "--markdown", str(page)]) == 2
    assert "bench_nothing.py: no such benchmark script" in capsys.readouterr().err


@pytest.mark.parametrize("script", [name for name, _, _ in write_page.SCRIPTS])
def test_every_benchmark_script_can_record_its_figures(script, monkeypatch, capsys):
    """Each script the page runs takes ``--record`` (its help says so), so no row is left to type.

    The script runs as ``__main__`` in this process (its imports are already loaded here), as
    ``python benchmarks/<script> --help`` would."""
    import runpy

    monkeypatch.setattr(sys, "argv", [str(REPO_ROOT / "benchmarks" / script), "--help"])
    monkeypatch.setattr(sys, "path", list(sys.path))  # the scripts put the repository first on it
    with pytest.raises(SystemExit) as done:
        runpy.run_path(str(REPO_ROOT / "benchmarks" / script), run_name="__main__")
    assert done.value.code in (0, None)
    assert "--record FILE" in capsys.readouterr().out
