"""``benchx recipe show``: print a recipe as training would use it (all layers and overrides merged).

The output is the fully resolved recipe (schema defaults, ``recipes/_base.yaml``, the recipe, its
profile and the ``key=value`` overrides), the same YAML a training run logs as ``recipe.yaml``; a
mistyped key or a wrong value is reported as an error, so this is also a cheap check of a command line.

Example::

    benchx recipe show --recipe recipes/unet.yaml profile=cpu trainer.max_steps=100
"""

from __future__ import annotations

import difflib
import sys
from typing import Sequence


def show(path: str, overrides: Sequence[str]) -> str:
    """The resolved recipe as YAML (raises RecipeError on a bad key or value)."""
    from lightning_modules.recipe import load_recipe, recipe_to_yaml

    return recipe_to_yaml(load_recipe(path, list(overrides)))


def main(argv: Sequence[str] | None = None) -> int:
    from lightning_modules.commands.common import CommandParser, add_overrides_argument, parse_command_line

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = CommandParser(prog="benchx recipe", description="Recipes: print one as it is resolved.")
    actions = parser.add_subparsers(dest="action", required=True, metavar="show")
    show_parser = actions.add_parser("show", help="print the resolved recipe", description=__doc__.split("\n\n")[0])
    show_parser.add_argument("--recipe", required=True, help="recipe YAML, e.g. recipes/unet.yaml")
    add_overrides_argument(show_parser)
    if argv and not argv[0].startswith("-") and argv[0] not in actions.choices:
        close = difflib.get_close_matches(argv[0], list(actions.choices), n=1, cutoff=0.5)
        guess = f"; did you mean {close[0]!r}?" if close else f" (choose from {', '.join(map(repr, actions.choices))})"
        parser.error(f"unknown subcommand {argv[0]!r}{guess}")
    if not argv or argv[0] != "show":
        parser.parse_args(argv)  # prints the usage (or --help) and exits
    args = parse_command_line(show_parser, argv[1:])
    print(show(args.recipe, args.overrides), end="")
    return 0
