"""The ``benchx`` command line: a thin dispatcher that loads each subcommand's module by name.

Each subcommand is a module-level ``main(argv) -> int`` with its own argparse parser, so
``benchx train --help`` imports only what training needs. The commands come from command tables:
the base's own (:mod:`lightning_modules.commands`) and one per installed package that declares one
in the entry-point group ``benchx.commands`` (SynthX does, in ``pyproject.toml``). The base names
none of another package's commands or errors (docs/explanation/architecture.md "Layering").

Errors a user can fix (a mistyped recipe key, a broken cohort, a leaking split, a missing run, ...)
are caught here, in one place, and printed as a short message with exit code 2; ``--debug`` (anywhere
on the command line, or ``BENCHX_DEBUG=1``) shows the traceback instead. The library warnings that
mean nothing to a user are filtered here too (:mod:`lightning_modules.infrastructure.warnings_filter`).

Example::

    benchx phantom --out data/phantom --cases 440
    benchx train --recipe recipes/unet.yaml profile=cpu
    benchx --version
"""

from __future__ import annotations

import difflib
import importlib
import os
import sys
from types import ModuleType

# The group through which each package contributes its command table (pyproject.toml).
ENTRY_POINT_GROUP = "benchx.commands"
BASE_TABLE = "lightning_modules.commands"


def command_tables() -> list[ModuleType]:
    """The base's command table, then every installed package's, by entry-point name."""
    from importlib.metadata import entry_points

    tables = [importlib.import_module(BASE_TABLE)]
    for point in sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda point: point.name):
        if point.value != BASE_TABLE:
            tables.append(point.load())
    return tables


def merged_tables(tables: list[ModuleType]) -> tuple[dict[str, tuple[str, str, str]], frozenset[str], dict[str, str]]:
    """Commands, expected errors and hints of all tables; two tables naming one command is an error."""
    commands: dict[str, tuple[str, str, str]] = {}
    errors: set[str] = set()
    hints: dict[str, str] = {}
    for table in tables:
        clash = sorted(set(commands) & set(table.COMMANDS))
        if clash:
            raise RuntimeError(f"{table.__name__} redefines the benchx command(s) {', '.join(clash)}")
        commands.update(table.COMMANDS)
        errors.update(getattr(table, "EXPECTED_ERRORS", ()))
        hints.update(getattr(table, "HINTS", {}))
    return commands, frozenset(errors), hints


COMMANDS, EXPECTED_ERRORS, HINTS = merged_tables(command_tables())

EXIT_USAGE = 2


def version() -> str:
    from lightning_modules import __version__

    return f"benchx {__version__}"


def usage() -> str:
    width = max(len(name) for name in COMMANDS)
    lines = ["usage: benchx [--version] [--debug] <command> [options]", "", "commands:"]
    lines += [f"  {name.ljust(width)}  {help_}" for name, (_, _, help_) in COMMANDS.items()]
    lines += [
        "",
        "options:",
        "  --version  print the version and exit",
        "  --debug    show the full traceback of an error (also BENCHX_DEBUG=1)",
        "",
        "Run 'benchx <command> --help' for a command's options, e.g. 'benchx train --help'.",
    ]
    return "\n".join(lines)


def unknown_command_message(name: str) -> str:
    """The message for a mistyped command: the closest command names, then the usage."""
    close = difflib.get_close_matches(name, list(COMMANDS), n=3, cutoff=0.5)
    guess = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    return f"benchx: unknown command {name!r}{guess}\n\n{usage()}"


def expected_error(error: BaseException) -> bool:
    """True for the project's own user-facing errors and for a run or model MLflow cannot find."""
    for cls in type(error).__mro__:
        if f"{cls.__module__}.{cls.__qualname__}" in EXPECTED_ERRORS:
            return True
    if type(error).__name__ == "MlflowException":
        return getattr(error, "error_code", "") in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE")
    return isinstance(error, FileNotFoundError)


def error_message(command: str, error: BaseException) -> str:
    """One or two lines: what is wrong (the error's own text) and how to fix it."""
    text = str(error).strip() or type(error).__name__
    hint = next((HINTS[cls.__name__] for cls in type(error).__mro__ if cls.__name__ in HINTS), None)
    lines = [f"benchx {command}: {text}"]
    if hint and hint not in text:
        lines.append(f"  hint: {hint}")
    lines.append("  (run again with --debug for the traceback)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv or os.environ.get("BENCHX_DEBUG", "") not in ("", "0")
    argv = [arg for arg in argv if arg != "--debug"]
    if argv and argv[0] == "--version":
        print(version())
        return 0
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(unknown_command_message(name), file=sys.stderr)
        return EXIT_USAGE
    from lightning_modules.commands.common import command_help
    from lightning_modules.infrastructure.warnings_filter import install

    install()
    # A command's log is read as text: MLflow's artifact download bars (one per file) say nothing there.
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    module_name, function, _ = COMMANDS[name]
    try:
        module = importlib.import_module(module_name)
        with command_help(name, module.__doc__):
            result = getattr(module, function)(rest)
    except Exception as error:
        if debug or not expected_error(error):
            raise
        print(error_message(name, error), file=sys.stderr)
        return EXIT_USAGE
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
