"""Run the benchmarks and write their figures into docs/benchmarks.md.

Each benchmark script runs ``--runs`` times, one after another, each time in a fresh process with
``--record`` (benchmarks/record.py); a figure measured several times is shown as its range. The
table, the machine it ran on and the commit whose code it measured replace the page's generated
block (between ``<!-- benchx-benchmarks:start -->`` and ``<!-- benchx-benchmarks:end -->``); the
rest of the page is prose. The code measured must be committed: the page names that commit, and a
test fails once the code it measured changes. On a machine without CUDA the GPU benchmark runs as
its ``--dry-run`` and its row says so.

Run from the repository root, with nothing else running (about 25 minutes for two runs on 2 cores)::

    .venv/bin/python benchmarks/write_page.py
    .venv/bin/python benchmarks/write_page.py --runs 3 --only bench_training_step.py

Exit 1 when a benchmark crashed (no rows), 2 when the code is not committed or the page has no block.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.record import merge_runs, read_rows  # noqa: E402
from synthx.workflows.report.markdown_page import ReportError, fill_results_block  # noqa: E402

BLOCK = ("<!-- benchx-benchmarks:start -->", "<!-- benchx-benchmarks:end -->")
# The scripts, in the page's order, with the arguments the page's figures use and the most runs
# each gets (None: --runs). DDPM's 1000 steps cost minutes per tumor on 2 cores: one tumor, one run.
SCRIPTS = (
    ("bench_training_step.py", [], None),
    ("bench_data_pipeline.py", [], None),
    ("bench_sliding_window.py", [], None),
    ("bench_subgroup_bootstrap.py", [], None),
    ("bench_synthx_sampling.py", ["--tumors", "1"], 1),
    ("bench_cpu_arithmetic.py", [], None),
    ("bench_cli_help.py", [], None),
    ("gpu_backbones.py", [], None),
)
# What the figures depend on: uncommitted changes here would make the page name the wrong code.
MEASURED_PATHS = ("lightning_modules", "synthx", "recipes", "benchmarks", "pyproject.toml", ".ci/constraints.txt")


class PageError(Exception):
    """The page cannot be written as asked (exit 2)."""


def machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor() or platform.machine())
    memory_kib = next(int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()
                      if line.startswith("MemTotal:"))
    versions = ", ".join(f"{name} {metadata.version(name)}" for name in ("torch", "monai", "lightning"))
    return f"{os.cpu_count()} CPUs ({cpu}), {memory_kib / 2**20:.0f} GiB RAM; {versions}"


def measured_commit(root: Path = ROOT) -> tuple[str, list[str]]:
    """HEAD and the uncommitted changes under :data:`MEASURED_PATHS`."""
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--", *MEASURED_PATHS], cwd=root, capture_output=True,
                           text=True, check=True).stdout.splitlines()
    return head, dirty


def run_script(script: Path, args: list[str], record: Path) -> int:
    print(f"== {script.name} {' '.join(args)}", flush=True)
    done = subprocess.run([sys.executable, str(script), *args, "--record", str(record)], cwd=ROOT)
    return done.returncode


def measure(scripts: list[tuple[Path, list[str], int]], runs: int) -> list[dict]:
    """Each script ``runs`` times (at most its own cap); the merged rows in order. A script that
    records nothing crashed."""
    merged = []
    with tempfile.TemporaryDirectory() as folder:
        for index, (script, args, cap) in enumerate(scripts):
            by_label: dict[str, list] = {}
            for run in range(min(runs, cap or runs)):
                record = Path(folder) / f"{index}-{run}.jsonl"
                code = run_script(script, args, record)
                rows = read_rows(record) if record.is_file() else []
                if not rows:
                    raise RuntimeError(f"{script.name} exited {code} and recorded no figures (run {run + 1})")
                for row in rows:
                    by_label.setdefault(row.label, []).append(row)
            counts = {label: len(rows) for label, rows in by_label.items()}
            if len(set(counts.values())) > 1:
                raise RuntimeError(f"{script.name} recorded other rows on other runs: {counts}")
            merged += [merge_runs(rows) for rows in by_label.values()]
    return merged


def table(rows: list[dict]) -> str:
    lines = ["| benchmark (script) | figures | ratio | target | met |", "|---|---|---|---|---|"]
    for row in rows:
        cells = [f"{row['label']} (`{row['script']}`)", row["figures"], row["ratio"], row["target"], row["met"]]
        lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    return "\n".join(lines)


def block_text(rows: list[dict], runs: int, commit: str, dirty: bool, when: str, on: str) -> str:
    code = f"at commit `{commit}`" + (" with uncommitted changes (not a result to publish)" if dirty else "")
    once = ", ".join(f"`{name}`" for name, _, cap in SCRIPTS if cap == 1 and runs > 1)
    return (f"Written by `benchmarks/write_page.py` {code}, {when}: each script run {runs} time(s) in a fresh "
            f"process, one after another{f' ({once} once)' if once else ''}; a range is the lowest and highest "
            f"of those runs.\n\n"
            f"Machine: {on}.\n\n{table(rows)}")


def fill_block(document: str, text: str) -> str:
    """``document`` with its benchmarks block holding ``text`` (the README blocks' filler, reused)."""
    try:
        return fill_results_block(document, text, BLOCK)
    except ReportError as error:
        raise PageError(str(error)) from error


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=2, help="runs of each script (default 2)")
    parser.add_argument("--only", nargs="*", default=None, metavar="SCRIPT",
                        help="these scripts (file names in benchmarks/, or paths) instead of all of them")
    parser.add_argument("--markdown", type=Path, default=ROOT / "docs" / "benchmarks.md")
    parser.add_argument("--allow-dirty", action="store_true",
                        help="measure uncommitted code (the page says so; the docs test refuses it)")
    args = parser.parse_args(argv)
    try:
        commit, dirty = measured_commit()
        if dirty and not args.allow_dirty:
            raise PageError("the page names the commit it measured, and the code has uncommitted changes:\n  "
                            + "\n  ".join(dirty[:10]) + "\ncommit them (or pass --allow-dirty for a trial page)")
        document = args.markdown.read_text(encoding="utf-8")
        fill_block(document, "")  # refuse before the runs, not after
        defaults = {name: (extra, cap) for name, extra, cap in SCRIPTS}
        names = args.only if args.only is not None else list(defaults)
        scripts = []
        for name in names:
            path = Path(name) if Path(name).is_file() else ROOT / "benchmarks" / name
            if not path.is_file():
                raise PageError(f"{name}: no such benchmark script")
            extra, cap = defaults.get(path.name, ([], None))
            if path.name == "gpu_backbones.py" and not cuda_available():
                extra = [*extra, "--dry-run"]
            scripts.append((path, extra, cap))
    except (PageError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    try:
        rows = measure(scripts, args.runs)
    except RuntimeError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    when = datetime.date.today().isoformat()
    text = block_text(rows, args.runs, commit, bool(dirty), when, machine())
    args.markdown.write_text(fill_block(args.markdown.read_text(encoding="utf-8"), text), encoding="utf-8")
    print(f"wrote {len(rows)} rows to {args.markdown}")
    return 0


def cuda_available() -> bool:
    probe = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.is_available())"],
                           capture_output=True, text=True)
    return probe.stdout.strip() == "True"


if __name__ == "__main__":
    sys.exit(main())
