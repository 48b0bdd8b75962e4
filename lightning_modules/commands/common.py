"""Argument helpers shared by the ``benchx`` commands: recipe overrides and the model source.

Commands only parse and call the library; these helpers keep the parsing rules identical across
commands, so ``key=value`` overrides and ``--run-id | --checkpoint`` mean the same thing everywhere.
"""

from __future__ import annotations

import argparse
from typing import Iterable


def split_overrides(values: Iterable[str]) -> list[str]:
    """``key=value`` recipe overrides from positional arguments.

    ``mlflow run`` passes all overrides as one space-separated parameter, so each value is split on
    whitespace; empty values are dropped.
    """
    return [part for value in values for part in str(value).split()]


def add_overrides_argument(parser: argparse.ArgumentParser) -> None:
    """Trailing ``key=value`` recipe overrides (dotted keys), applied after the recipe and profile."""
    parser.add_argument("overrides", nargs="*", help="key=value recipe overrides, e.g. profile=cpu trainer.max_steps=100")


def run_id(text: str) -> str:
    """argparse type of an MLflow run id: its shape is checked before any look-up (``../../etc`` is refused)."""
    from lightning_modules.tracking import check_run_id

    try:
        return check_run_id(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from error


def add_model_source_arguments(parser: argparse.ArgumentParser, recipe_help: str | None = None) -> None:
    """``--run-id RUN`` or ``--checkpoint FILE --recipe YAML``: the trained model a command uses."""
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--run-id", type=run_id, help="MLflow training run (its recipe.yaml and best checkpoint are used)")
    source.add_argument("--checkpoint", help="a checkpoint file (needs --recipe)")
    parser.add_argument("--recipe", help=recipe_help or "recipe for --checkpoint, or one that replaces the run's recipe")
