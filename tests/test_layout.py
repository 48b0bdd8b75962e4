"""The layout's rules, checked on the source: no import cycles (imports inside functions count), the
base package never imports synthx, and code cites only documents that ship with the repository."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from conftest import REPO_ROOT

PACKAGES = ("lightning_modules", "synthx")


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO_ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _sources() -> dict[str, Path]:
    return {_module_name(p): p for package in PACKAGES for p in sorted((REPO_ROOT / package).rglob("*.py"))}


def import_graph() -> dict[str, set[str]]:
    """module -> the project's modules it imports anywhere in its body (functions included)."""
    sources = _sources()
    graph: dict[str, set[str]] = {}
    for name, path in sources.items():
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                candidates = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.Import):
                candidates = [alias.name for alias in node.names]
            else:
                continue
            targets.update(c for c in candidates if c in sources and c != name)
        graph[name] = targets
    return graph


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm: the groups of modules that import each other, directly or not."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for node in graph:
        if node not in index:
            visit(node)
    return groups


def test_cycle_finder_finds_a_planted_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert strongly_connected(graph) == [["a", "b", "c"]]


def test_no_import_cycles_among_the_projects_modules():
    cycles = strongly_connected(import_graph())
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(group) for group in cycles)


def test_base_package_never_imports_synthx():
    offenders = sorted(
        f"{module} imports {target}"
        for module, targets in import_graph().items()
        if module.startswith("lightning_modules")
        for target in targets
        if target.startswith("synthx")
    )
    assert not offenders, offenders


@pytest.mark.parametrize("pattern", [r"DESIGN\.md", r"(?i)\bissue \d+\b", r"(?i)\bissues? #\d+"])
def test_code_cites_only_what_ships_with_it(pattern):
    files = [p for package in PACKAGES for p in (REPO_ROOT / package).rglob("*.py")]
    files += list((REPO_ROOT / "recipes").rglob("*.yaml")) + [REPO_ROOT / "MLproject"]
    hits = [
        f"{path.relative_to(REPO_ROOT)}:{number}"
        for path in files
        for number, line in enumerate(path.read_text().splitlines(), start=1)
        if re.search(pattern, line)
    ]
    assert not hits, f"{pattern} cited in: {hits}"


def test_cited_design_sections_exist():
    design = (REPO_ROOT / "docs" / "design.md").read_text()
    sections = set(re.findall(r"^## (.+)$", design, flags=re.MULTILINE))
    files = [p for package in PACKAGES for p in (REPO_ROOT / package).rglob("*.py")]
    cited = {
        (path.relative_to(REPO_ROOT), title)
        for path in files
        for title in re.findall(r'docs/design\.md[,:]? "([^"]+)"', path.read_text())
    }
    missing = sorted(f"{path}: {title!r}" for path, title in cited if title not in sections)
    assert not missing, f"citations of sections docs/design.md does not have: {missing}"


def _synthx_module_names() -> set[str]:
    return {name for name in _sources() if name.startswith("synthx.")} | {"synthx"}


def test_base_package_names_no_synthx_module_even_as_a_string():
    """The base reaches SynthX's commands only through the ``benchx.commands`` entry points."""
    synthx_modules = _synthx_module_names()
    named = []
    for name, path in _sources().items():
        if not name.startswith("lightning_modules"):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                for word in re.findall(r"\bsynthx(?:\.[A-Za-z_]+)+", node.value):
                    # "synthx.generation.canvases.GenerationError" names a module by its prefix.
                    parts = word.split(".")
                    if any(".".join(parts[:i]) in synthx_modules for i in range(2, len(parts) + 1)):
                        named.append(f"{name}: {word}")
    assert not named, "the base names SynthX modules: " + ", ".join(sorted(set(named)))


def test_every_package_contributes_its_commands_through_the_entry_point_group():
    from lightning_modules import cli
    import synthx.commands

    assert set(synthx.commands.COMMANDS) <= set(cli.COMMANDS) and "train" in cli.COMMANDS
    assert synthx.commands.EXPECTED_ERRORS <= cli.EXPECTED_ERRORS
    tables = cli.command_tables()
    assert [t.__name__ for t in tables] == ["lightning_modules.commands", "synthx.commands"]


def test_two_tables_naming_one_command_are_refused():
    from types import SimpleNamespace

    from lightning_modules import cli

    first = SimpleNamespace(__name__="a", COMMANDS={"train": ("a", "main", "")})
    second = SimpleNamespace(__name__="b", COMMANDS={"train": ("b", "main", "")}, EXPECTED_ERRORS=frozenset())
    with pytest.raises(RuntimeError, match="b redefines the benchx command"):
        cli.merged_tables([first, second])


# The libraries and what each may import of the project. Workflows (lightning_modules.workflows,
# the commands, synthx's study, sweep, replicates, report and runs) sit above them and reach MLflow
# only through the tracking adapter (lightning_modules.tracking).
LIBRARY_IMPORTS = {
    # config is the bottom: the schema every layer reads its own section from.
    "lightning_modules.config": {"lightning_modules.config"},
    "lightning_modules.data": {"lightning_modules.data", "lightning_modules.config",
                               "lightning_modules.infrastructure.files"},
    "lightning_modules.cohorts": {"lightning_modules.cohorts", "lightning_modules.data",
                                  "lightning_modules.infrastructure.run_folder", "lightning_modules.infrastructure.files"},
    "lightning_modules.evaluation": {"lightning_modules.evaluation", "lightning_modules.data", "lightning_modules.config",
                                     "lightning_modules.infrastructure.recording"},
    "lightning_modules.models": {"lightning_modules.models", "lightning_modules.config", "lightning_modules.data"},
    "lightning_modules.inference": {"lightning_modules.inference", "lightning_modules.config", "lightning_modules.data",
                                    "lightning_modules.models", "lightning_modules.infrastructure.files"},
    # The whole recipe: loaded once, each section checked by the layer that owns it.
    "lightning_modules.recipe": {"lightning_modules.recipe", "lightning_modules.config", "lightning_modules.data",
                                 "lightning_modules.models"},
    # Shared infrastructure, below every layer that uses it: run folders (locks, fingerprints,
    # resumable checkpoints), process handling (signals, worker lifetimes), resource monitoring, the
    # warnings filter and atomic file writes. Each stands alone; run folders write through files.
    "lightning_modules.infrastructure.files": {"lightning_modules.infrastructure.files"},
    "lightning_modules.infrastructure.run_folder": {"lightning_modules.infrastructure.run_folder",
                                                    "lightning_modules.infrastructure.files"},
    "lightning_modules.infrastructure.process": {"lightning_modules.infrastructure.process"},
    "lightning_modules.infrastructure.monitoring": {"lightning_modules.infrastructure.monitoring"},
    "lightning_modules.infrastructure.warnings_filter": {"lightning_modules.infrastructure.warnings_filter"},
    "lightning_modules.infrastructure.recording": {"lightning_modules.infrastructure.recording"},
}
# synthx's libraries, bottom to top: the recipe schema and vocabularies; the generator; the study's
# statistics (analysis); the library parts of training (data, Lightning modules) and generation
# (targeting, canvases, painting, writing).
SYNTHX_LIBRARIES = (
    "synthx.config", "synthx.conditions", "synthx.painters", "synthx.generator", "synthx.analysis",
    "synthx.training.dataset", "synthx.training.modules",
    "synthx.generation.cells", "synthx.generation.targeting", "synthx.generation.canvases", "synthx.generation.painting",
    "synthx.generation.phantom_painter", "synthx.generation.writing", "synthx.generation.copy_paste",
)
# What each synthx library may import of synthx: the generator knows nothing of the study, the
# study's statistics nothing of the generator, and neither imports training or generation.
SYNTHX_LIBRARY_IMPORTS = {
    "synthx.conditions": {"synthx.conditions"},
    "synthx.painters": {"synthx.painters"},
    "synthx.config": {"synthx.config", "synthx.conditions"},
    "synthx.generator": {"synthx.generator", "synthx.conditions"},
    "synthx.analysis": {"synthx.analysis", "synthx.painters"},
    "synthx.training": {"synthx.training", "synthx.generator", "synthx.config", "synthx.conditions"},
    "synthx.generation": {"synthx.generation", "synthx.generator", "synthx.config", "synthx.conditions", "synthx.painters"},
}
# synthx's modules that sit above its libraries and still call MLflow themselves: generation and
# training runs log their outputs (the targeting table among them); the pyfunc model (serving)
# wraps the pipeline for the registry. They are workflows in the layout.
SYNTHX_WORKFLOW_MODULES = (
    "synthx.generation.run", "synthx.generation.source", "synthx.training.run", "synthx.serving.pyfunc",
    "synthx.serving.pyfunc_code",
)
# Packages whose __init__ only gathers names (no layer of their own).
PACKAGE_ROOTS = ("lightning_modules", "lightning_modules.infrastructure", "synthx", "synthx.generation", "synthx.training",
                 "synthx.generator", "synthx.analysis", "synthx.serving")
SERVICE_CLIENTS = ("mlflow", "optuna")
ABOVE_LIBRARIES = ("lightning_modules.tracking", "lightning_modules.workflows", "lightning_modules.commands",
                   "lightning_modules.cli", "lightning_modules.trainer", "synthx.workflows", "synthx.commands")


def all_imports() -> dict[str, set[str]]:
    """module -> every module name it imports anywhere in its body (functions included), third-party too."""
    found: dict[str, set[str]] = {}
    for name, path in _sources().items():
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets.update([node.module] + [f"{node.module}.{alias.name}" for alias in node.names])
            elif isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
        found[name] = targets
    return found


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def library_violations(imports: dict[str, set[str]]) -> list[str]:
    """Imports of the libraries that break the table: MLflow or Optuna, a workflow, or a package not allowed."""
    sources = set(_sources())
    problems = []
    for module, targets in sorted(imports.items()):
        package = next((p for p in LIBRARY_IMPORTS if _within(module, p)), None)
        is_synthx_library = any(_within(module, library) for library in SYNTHX_LIBRARIES)
        if package is None and not is_synthx_library:
            continue
        for target in sorted(targets):
            if target.split(".")[0] in SERVICE_CLIENTS or any(_within(target, above) for above in ABOVE_LIBRARIES):
                problems.append(f"{module} imports {target}")
            elif package and target in sources and target.startswith("lightning_modules") and not any(
                _within(target, allowed) for allowed in LIBRARY_IMPORTS[package]
            ):
                problems.append(f"{module} imports {target}, outside {sorted(LIBRARY_IMPORTS[package])}")
            elif is_synthx_library and _within(target, "synthx") and (target in sources or target.rsplit(".", 1)[0] in sources):
                layer = next(p for p in SYNTHX_LIBRARY_IMPORTS if _within(module, p))
                if not any(_within(target, allowed) for allowed in SYNTHX_LIBRARY_IMPORTS[layer]):
                    problems.append(f"{module} imports {target}, outside {sorted(SYNTHX_LIBRARY_IMPORTS[layer])}")
    return problems


# The library functions still built from a whole recipe: what is made of all of it (the
# SegmentationModule: backbone, loss, optimizer, inference settings; planning rewrites data and
# model together; SynthX's Lightning modules). Every other library function takes its own section.
WHOLE_RECIPE_LIBRARY_FUNCTIONS = {
    "lightning_modules.models.checkpoints.build_module",
    "lightning_modules.models.checkpoints.load_module_from_checkpoint",
    "lightning_modules.models.planning.resolve_planned_recipe",
    "synthx.training.modules.SynthXTrainingModule.from_recipe",
    "synthx.training.modules.SynthXAutoencoderModule.from_recipe",
    # A run folder's identity is the fingerprint of the whole recipe (a changed key refuses a resume).
    "lightning_modules.infrastructure.run_folder.recipe_keys",
    "lightning_modules.infrastructure.run_folder.recipe_fingerprint",
    "lightning_modules.infrastructure.run_folder.RunRecord.for_recipe",
    "lightning_modules.infrastructure.run_folder.check_same_recipe",
}


def whole_recipe_functions(sources: dict[str, Path]) -> set[str]:
    """``module.function`` (``module.Class.method``) of every library function with a ``recipe`` parameter."""
    found = set()
    for module, path in sources.items():
        is_library = any(_within(module, p) for p in LIBRARY_IMPORTS if p != "lightning_modules.recipe") or any(
            _within(module, library) for library in SYNTHX_LIBRARIES)
        if not is_library:
            continue
        tree = ast.parse(path.read_text(), str(path))
        scopes = [(node, "") for node in tree.body]
        while scopes:
            node, prefix = scopes.pop()
            if isinstance(node, ast.ClassDef):
                scopes += [(child, f"{prefix}{node.name}.") for child in node.body]
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                arguments = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
                if any(argument.arg == "recipe" for argument in arguments):
                    found.add(f"{module}.{prefix}{node.name}")
    return found


def test_libraries_take_their_own_recipe_section_not_the_whole_recipe():
    assert whole_recipe_functions(_sources()) == WHOLE_RECIPE_LIBRARY_FUNCTIONS


def test_the_section_check_finds_a_library_function_taking_the_whole_recipe(tmp_path):
    planted = tmp_path / "datamodule.py"
    planted.write_text("class Loader:\n    def __init__(self, recipe, seed):\n        pass\n\ndef f(data):\n    return data\n")
    assert whole_recipe_functions({"lightning_modules.data.datamodule": planted}) == {
        "lightning_modules.data.datamodule.Loader.__init__"}
    assert whole_recipe_functions({"lightning_modules.workflows.train": planted}) == set(), "a workflow may"


def test_libraries_import_neither_mlflow_nor_a_workflow_nor_a_layer_above():
    violations = library_violations(all_imports())
    assert not violations, violations


def test_the_library_table_catches_mlflow_a_workflow_and_an_upward_import():
    planted = {
        "lightning_modules.data.mixing": {"mlflow.tracking"},
        "lightning_modules.models.checkpoints": {"lightning_modules.tracking"},
        "lightning_modules.evaluation.records": {"lightning_modules.models.checkpoints"},
        "synthx.generator.pipeline": {"lightning_modules.workflows.train"},
        "lightning_modules.config.recipe": {"lightning_modules.models.backbones"},
        "lightning_modules.data.datamodule": {"lightning_modules.recipe", "lightning_modules.config.recipe"},
        "lightning_modules.workflows.train": {"mlflow"},  # a workflow may
    }
    assert library_violations(planted) == [
        "lightning_modules.config.recipe imports lightning_modules.models.backbones, outside ['lightning_modules.config']",
        "lightning_modules.data.datamodule imports lightning_modules.recipe, outside "
        "['lightning_modules.config', 'lightning_modules.data', 'lightning_modules.infrastructure.files']",
        "lightning_modules.data.mixing imports mlflow.tracking",
        "lightning_modules.evaluation.records imports lightning_modules.models.checkpoints, outside "
        "['lightning_modules.config', 'lightning_modules.data', 'lightning_modules.evaluation', "
        "'lightning_modules.infrastructure.recording']",
        "lightning_modules.models.checkpoints imports lightning_modules.tracking",
        "synthx.generator.pipeline imports lightning_modules.workflows.train",
    ]


def test_the_synthx_layers_catch_an_import_across_them():
    planted = {
        "synthx.generator.model": {"synthx.analysis.verdict"},  # the generator knows nothing of the study
        "synthx.analysis.realism": {"synthx.generator.pipeline", "synthx.painters"},
        "synthx.generation.canvases": {"synthx.training.dataset", "synthx.generation.targeting.CELL_COLUMNS"},
        "synthx.training.run": {"synthx.serving.pyfunc"},  # a workflow may
    }
    assert library_violations(planted) == [
        "synthx.analysis.realism imports synthx.generator.pipeline, outside ['synthx.analysis', 'synthx.painters']",
        "synthx.generation.canvases imports synthx.training.dataset, outside ['synthx.conditions', 'synthx.config', "
        "'synthx.generation', 'synthx.generator', 'synthx.painters']",
        "synthx.generator.model imports synthx.analysis.verdict, outside ['synthx.conditions', 'synthx.generator']",
    ]


def unplaced_modules(modules) -> list[str]:
    """The modules the layout table does not place: in no library, no layer above them, no workflow list."""
    return sorted(
        module for module in modules
        if module not in PACKAGE_ROOTS
        and not any(_within(module, package) for package in LIBRARY_IMPORTS)
        and not any(_within(module, library) for library in SYNTHX_LIBRARIES)
        and not any(_within(module, above) for above in ABOVE_LIBRARIES)
        and module not in SYNTHX_WORKFLOW_MODULES
    )


def test_every_module_has_its_place_in_the_layout_table():
    assert unplaced_modules(_sources()) == []


def test_a_new_module_outside_the_table_is_named():
    assert unplaced_modules(["synthx.generator.model", "synthx.helpers", "lightning_modules.utils", "lightning_modules"]) == [
        "lightning_modules.utils", "synthx.helpers"]


def test_the_workflow_list_holds_only_modules_that_exist():
    assert set(SYNTHX_WORKFLOW_MODULES) <= set(_sources())
    assert set(SYNTHX_LIBRARIES) <= set(_sources())
