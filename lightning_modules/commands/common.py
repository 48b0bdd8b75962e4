"""Argument helpers shared by the ``benchx`` commands: the parser, recipe overrides and the model source.

Commands only parse and call the library; these helpers keep the parsing rules identical across
commands, so ``key=value`` overrides and ``--run-id | --checkpoint`` mean the same thing everywhere,
and every ``--help`` shows its defaults and an example the same way (:func:`command_parser`).
"""

from __future__ import annotations

import argparse
import re
from typing import Iterable


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults shown after each option's help; description and example printed as written."""


def plain_text(text: str) -> str:
    """Docstring prose for a terminal: reStructuredText ``literals`` and :role:`targets` unquoted."""
    text = re.sub(r":[a-z]+:`~?([^`]+)`", r"\1", text)
    return text.replace("``", "'").replace("`", "'")


def doc_parts(doc: str | None) -> tuple[str, str]:
    """(first paragraph, the ``Example::`` block) of a module docstring, as plain text."""
    doc = (doc or "").strip()
    description = plain_text(doc.split("\n\n")[0].strip())
    example = ""
    match = re.search(r"Examples?::\s*\n((?:\s*\n|[ \t]+.*\n?)+)", doc + "\n")
    if match:
        lines = [line.strip() for line in match.group(1).splitlines() if line.strip()]
        example = "\n".join(f"  {line}" for line in lines)
    return description, example


def command_parser(
    name: str, doc: str | None, description: str | None = None, example: str | None = None
) -> argparse.ArgumentParser:
    """The parser of ``benchx <name>``: defaults in the help, and the example from the module docstring.

    Args:
        name: the subcommand (``train``, ``recipe show``, ...).
        doc: the command module's docstring: its first paragraph is the description and its
            ``Example::`` block the example, unless given explicitly.
        description: replaces the docstring's first paragraph.
        example: replaces the docstring's example (one command per line).
    """
    doc_description, doc_example = doc_parts(doc)
    example = doc_example if example is None else "\n".join(f"  {line}" for line in example.splitlines())
    return argparse.ArgumentParser(
        prog=f"benchx {name}",
        description=plain_text(description) if description else doc_description,
        epilog=f"example:\n{example}" if example else None,
        formatter_class=HelpFormatter,
    )


def split_overrides(values: Iterable[str]) -> list[str]:
    """``key=value`` recipe overrides from positional arguments.

    ``mlflow run`` passes all overrides as one space-separated parameter, so each value is split on
    whitespace; empty values are dropped.
    """
    return [part for value in values for part in str(value).split()]


def add_overrides_argument(parser: argparse.ArgumentParser) -> None:
    """Trailing ``key=value`` recipe overrides (dotted keys), applied after the recipe and profile."""
    parser.add_argument("overrides", nargs="*", help="key=value recipe overrides, e.g. profile=cpu trainer.max_steps=100")


def add_model_source_arguments(parser: argparse.ArgumentParser, recipe_help: str | None = None) -> None:
    """``--run-id RUN`` (or ``models:/NAME@ALIAS``) or ``--checkpoint FILE --recipe YAML``: the trained model a command uses."""
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--run-id",
        help="MLflow training run (its recipe.yaml and best checkpoint are used), or a registered model "
        "URI such as models:/benchx-unet@baseline",
    )
    source.add_argument("--model-uri", dest="run_id", help="same as --run-id, e.g. models:/benchx-unet/3")
    source.add_argument("--checkpoint", help="a checkpoint file (needs --recipe)")
    parser.add_argument("--recipe", help=recipe_help or "recipe for --checkpoint, or one that replaces the run's recipe")
