"""Benchmark: wall time of ``benchx <command> --help`` and of a mistyped recipe key, in fresh processes.

A help text, and the refusal of a command line with a mistyped recipe key, should appear in well
under a second: each command parses its arguments and checks its recipe before it imports the heavy
libraries (torch, Lightning, MONAI, MLflow, Optuna, diffusers). This prints, per command, the median
of a few runs of ``--help`` and, for the commands that read a recipe, of the same command with the
unknown key ``zz_mistyped.key=1`` (which must exit 2); it asserts nothing (timing depends on the
machine).

Run::

    .venv/bin/python benchmarks/bench_cli_help.py
    .venv/bin/python benchmarks/bench_cli_help.py --repeat 5 train study

Not collected by pytest (no ``test_`` prefix).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
MISTYPED = "zz_mistyped.key=1"
SEGMENTATION = str(REPO_ROOT / "recipes" / "unet.yaml")
GENERATOR = str(REPO_ROOT / "recipes" / "generator" / "synthx.yaml")
# The command line of each command that reads a recipe, with a mistyped key (exit code 2 expected).
MISTYPED_KEY = {
    "recipe": ["recipe", "show", "--recipe", SEGMENTATION, MISTYPED],
    "train": ["train", "--recipe", SEGMENTATION, MISTYPED],
    "study": ["study", "--recipe", SEGMENTATION, MISTYPED],
    "sweep": ["sweep", "--recipe", SEGMENTATION, MISTYPED],
    "synthx-train": ["synthx-train", "--recipe", GENERATOR, MISTYPED],
}


def time_command(args: list[str], repeat: int, expected: int, env: dict[str, str]) -> float:
    """Median wall seconds of ``benchx <args>`` (NaN when it did not exit with ``expected``)."""
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "lightning_modules.cli", *args], env=env, cwd=REPO_ROOT,
                              capture_output=True, text=True)
        times.append(time.perf_counter() - started)
        if done.returncode != expected:
            print(f"  benchx {' '.join(args)}: exit {done.returncode}, not {expected}: {done.stderr.strip()[-300:]}")
            return float("nan")
    return statistics.median(times)


def cell(seconds: float | None) -> str:
    if seconds is None:
        return f"{'-':>12}"
    return f"{seconds:>10.2f}{' !' if seconds >= 1.0 else '  '}"


def main() -> int:
    sys.path.insert(0, str(REPO_ROOT))
    from benchmarks.record import Row, add_record_argument, record
    from lightning_modules.cli import COMMANDS

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("commands", nargs="*", default=["", *COMMANDS], help="commands to time ('' = benchx --help)")
    parser.add_argument("--repeat", type=int, default=3)
    add_record_argument(parser)
    args = parser.parse_args()
    helps, keys = {}, {}
    with tempfile.TemporaryDirectory() as folder:
        # A store that is never created: a refusal must come before any store exists.
        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "MLFLOW_TRACKING_URI": f"sqlite:///{folder}/mlflow.db"}
        print(f"{'command':<16}{'--help s':>12}{'mistyped key s':>16}   (median of {args.repeat}; ! = 1 s or more)")
        for command in args.commands:
            argv = ["--help"] if not command else ([command, "show", "--help"] if command == "recipe" else [command, "--help"])
            help_s = time_command(argv, args.repeat, 0, env)
            key_s = time_command(MISTYPED_KEY[command], args.repeat, 2, env) if command in MISTYPED_KEY else None
            print(f"{command or '(benchx)':<16}{cell(help_s)}{'':>4}{cell(key_s)}")
            helps[command or "benchx"] = help_s
            if key_s is not None:
                keys[command] = key_s
    slowest_help, slowest_key = max(helps, key=helps.get), max(keys, key=keys.get)
    met = all(s < 1.0 for s in [*helps.values(), *keys.values()])  # NaN (a wrong exit code) is not met
    record(args.record, Row(
        label=f"`--help` and a mistyped recipe key, {len(helps)} commands, fresh processes",
        script="bench_cli_help.py",
        figures={"help": (helps[slowest_help], ".2f"), "key": (keys[slowest_key], ".2f")},
        text=(f"slowest `--help` {{help}} s (`{slowest_help}`), slowest mistyped key {{key}} s (`{slowest_key}`), "
              f"median of {args.repeat}"),
        target="< 1 s each", met=met))
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
