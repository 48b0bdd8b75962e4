"""Argument helpers shared by the ``benchx`` commands: the parser, recipe overrides and the model source.

Commands only parse and call the library; these helpers keep the parsing rules identical across
commands, so ``key=value`` overrides and ``--run-id | --checkpoint`` mean the same thing everywhere,
and every ``--help`` shows its defaults and an example the same way (:func:`command_help`).
"""

from __future__ import annotations

import argparse
import contextlib
import re
import shlex
from typing import Iterable, Sequence


class CommandParser(argparse.ArgumentParser):
    """The parser of every ``benchx`` command: an abbreviated option (``--profil``) is refused, not
    silently taken as the option it starts (``--profile``). Its subcommand parsers are of the same class."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults shown after each option's help; reStructuredText quoting removed; description and
    example printed as written.

    An empty default (None, False, an empty list or string) is not shown: "(default: None)" says nothing.
    """

    def _get_help_string(self, action: argparse.Action) -> str:
        text = plain_text(action.help or "")
        if not _shown(action.default) or "%(default)" in text or "(default:" in text:
            return text
        action_help, action.help = action.help, text
        try:
            return super()._get_help_string(action)
        finally:
            action.help = action_help

    def _format_action(self, action: argparse.Action) -> str:
        if not action.help and action.help is not argparse.SUPPRESS and _shown(action.default):
            action.help = "default: %(default)s"
        return super()._format_action(action)

    def _format_text(self, text: str) -> str:
        # "``benchx train``: train a backbone ..." -> "Train a backbone ...": the usage line names the command.
        text = re.sub(r"^\s*``benchx [^`]*``\s*(\([^)]*\))?:\s*(\w)", lambda m: m.group(2).upper(), text)
        return super()._format_text(plain_text(text))


def _shown(default) -> bool:
    """Whether a default says something (None, False, an empty list or string, SUPPRESS do not)."""
    return default is not argparse.SUPPRESS and default not in (None, False, [], "")


def plain_text(text: str) -> str:
    """Docstring prose for a terminal: reStructuredText ``literals`` and :role:`targets` unquoted."""
    text = re.sub(r":[a-z]+:`~?([^`]+)`", r"\1", text)
    return text.replace("``", "'").replace("`", "'")


def doc_example(doc: str | None) -> str:
    """The ``Example::`` block of a module docstring, one indented command per line ('' if none)."""
    match = re.search(r"(?:Examples?|Run|Usage)::\s*\n((?:\s*\n|[ \t]+.*\n?)+)", (doc or "") + "\n")
    if not match:
        return ""
    return "\n".join(f"  {line.strip()}" for line in match.group(1).splitlines() if line.strip())


@contextlib.contextmanager
def command_help(command: str, doc: str | None):
    """While a ``benchx`` command parses its arguments, every parser it builds uses :class:`HelpFormatter`,
    and its top-level parser (``prog`` "benchx <command>") gets the module docstring's example as epilog.

    Applied once, by the dispatcher (``lightning_modules.cli``), so every command's ``--help`` looks
    the same without each command repeating it.
    """
    original = argparse.ArgumentParser.__init__
    example = doc_example(doc)

    def init(self, *args, **kwargs):
        if kwargs.get("formatter_class", argparse.HelpFormatter) in (
            argparse.HelpFormatter, argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter
        ):
            kwargs["formatter_class"] = HelpFormatter
        if example and not kwargs.get("epilog") and str(kwargs.get("prog", "")).startswith(f"benchx {command}"):
            kwargs["epilog"] = f"example:\n{example}"
        original(self, *args, **kwargs)

    argparse.ArgumentParser.__init__ = init
    try:
        yield
    finally:
        argparse.ArgumentParser.__init__ = original


# One recipe override: a dotted key (OmegaConf's ``+key`` / ``~key`` spellings too), "=", a value.
OVERRIDE = re.compile(r"[+~]?[\w.\[\]-]+=")


def split_overrides(values: Iterable[str]) -> list[str]:
    """``key=value`` recipe overrides from positional arguments.

    ``mlflow run`` passes all overrides as one parameter (``-P overrides="profile=cpu trainer.max_steps=5"``),
    so an argument is split shell-style into several overrides when every part is itself ``key=value``;
    a value with a space is quoted there (``data.root='/x/my data/ph'``). An argument whose parts are
    not all ``key=value`` is one override as given, so ``"data.root=/x/my data/ph"`` stays one value.
    Empty arguments are dropped.
    """
    overrides = []
    for value in map(str, values):
        try:
            parts = shlex.split(value)
        except ValueError:  # an unbalanced quote: a value such as O'Brien, taken as written
            parts = value.split()
        if len(parts) > 1 and not all(OVERRIDE.match(part) for part in parts):
            parts = [value.strip()]
        overrides.extend(parts)
    return overrides


def add_overrides_argument(parser: argparse.ArgumentParser) -> None:
    """``key=value`` recipe overrides (dotted keys), applied after the recipe and profile, and
    ``--profile NAME``, the same as the override ``profile=NAME`` (both spellings work in every command).

    Parse with :func:`parse_command_line`, so options and overrides may come in any order.
    """
    parser.add_argument("overrides", nargs="*", help="key=value recipe overrides, e.g. profile=cpu trainer.max_steps=100")
    parser.add_argument("--profile", default=None, help="recipe profile, the same as the override profile=NAME (e.g. cpu)")


class ProfileConflict(ValueError):
    """``--profile`` and a ``profile=`` override name two different profiles."""


def parse_command_line(parser: argparse.ArgumentParser, argv: Sequence[str]) -> argparse.Namespace:
    """Parse ``argv`` with options and positional overrides in any order (``--out`` may follow them).

    When the parser has recipe overrides (:func:`add_overrides_argument`), ``args.overrides`` is
    the flat list of ``key=value`` strings (``mlflow run``'s space-joined parameter split), with
    ``--profile NAME`` turned into ``profile=NAME``, and ``args.profile`` the profile named either way
    (None when neither names one).
    """
    args = parser.parse_intermixed_args(list(argv))
    if not hasattr(args, "overrides"):
        return args
    overrides = split_overrides(args.overrides)
    named = [item.split("=", 1)[1] for item in overrides if item.split("=", 1)[0].strip() == "profile"]
    if args.profile is not None:
        if any(value != args.profile for value in named):
            raise ProfileConflict(f"--profile {args.profile} and profile={named[-1]} name different profiles; give one")
        if not named:
            overrides = [f"profile={args.profile}", *overrides]
    elif named:
        args.profile = named[-1]
    args.overrides = overrides
    return args


def bounded(kind: type, minimum: float, *, above: bool = False):
    """argparse type of a finite number from ``minimum`` up: ``bounded(int, 1)`` refuses ``0`` at parse
    time with "must be an integer >= 1, got 0" (exit code 2). ``above``: the minimum itself is refused."""
    wanted = f"{'an integer' if kind is int else 'a number'} {'>' if above else '>='} {minimum:g}"

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {wanted}, got {text!r}") from None
        if value != value or value in (float("inf"), float("-inf")) or (value <= minimum if above else value < minimum):
            raise argparse.ArgumentTypeError(f"must be {wanted}, got {text}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its messages
    return parse


def run_id(text: str) -> str:
    """argparse type of an MLflow run id: its shape is checked before any look-up (``../../etc`` is refused).
    A registered model URI (``models:/NAME@ALIAS`` or ``models:/NAME/VERSION``) passes unchanged."""
    from lightning_modules.tracking import check_run_id

    if text.startswith("models:/"):
        return text
    try:
        return check_run_id(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from error


def add_model_source_arguments(parser: argparse.ArgumentParser, recipe_help: str | None = None) -> None:
    """``--run-id RUN`` (or ``models:/NAME@ALIAS``) or ``--checkpoint FILE --recipe YAML``: the trained model a command uses."""
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--run-id",
        type=run_id,
        help="MLflow training run (its recipe.yaml and best checkpoint are used), or a registered model "
        "URI such as models:/benchx-unet@benchx-study-baseline",
    )
    source.add_argument("--model-uri", dest="run_id", type=run_id, metavar="URI", help="same as --run-id, e.g. models:/benchx-unet/3")
    source.add_argument("--checkpoint", help="a checkpoint file (needs --recipe)")
    parser.add_argument("--recipe", help=recipe_help or "recipe for --checkpoint, or one that replaces the run's recipe")
