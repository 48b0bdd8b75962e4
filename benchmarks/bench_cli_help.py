"""Benchmark: wall time of ``benchx --help`` and ``benchx <command> --help`` in fresh processes.

A help text should appear in well under a second, which needs each command module to import heavy
libraries (torch, Lightning, MONAI, MLflow, diffusers) inside the function that uses them. This
prints the median of a few runs per command; it asserts nothing (timing depends on the machine).

Run::

    .venv/bin/python benchmarks/bench_cli_help.py
    .venv/bin/python benchmarks/bench_cli_help.py --repeat 5 train predict

Not collected by pytest (no ``test_`` prefix).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def time_help(args: list[str], repeat: int) -> float:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        subprocess.run([sys.executable, "-m", "lightning_modules.cli", *args], env=env, capture_output=True, check=True)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    sys.path.insert(0, str(REPO_ROOT))
    from lightning_modules.cli import COMMANDS

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("commands", nargs="*", default=["", *COMMANDS], help="commands to time ('' = benchx --help)")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    print(f"{'command':<28}{'median s':>10}")
    for command in args.commands:
        argv = ["--help"] if not command else ([command, "show", "--help"] if command == "recipe" else [command, "--help"])
        seconds = time_help(argv, args.repeat)
        print(f"{('benchx ' + ' '.join(argv)):<28}{seconds:>10.2f}{'' if seconds < 1.0 else '   (over 1 s)'}")


if __name__ == "__main__":
    main()
