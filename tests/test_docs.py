"""The repository's documents speak to users: no development diary, a README that fits, links that resolve.

History lives in git and CHANGELOG.md; figures come from commands (``benchx report --markdown``), so
tracked documents and recipes must not narrate how they were made (session numbers, UTC times, host
diaries, commit hashes as narrative, first-person probes).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]

DIARY_PATTERNS = {
    "a session number": re.compile(r"\b[Ss]ession \d+"),
    "a UTC time": re.compile(r"\b\d{1,2}:\d{2}(:\d{2})? ?UTC\b"),
    "a host diary": re.compile(r"\b(this|a faster|a slower|an idle|the idle) host\b|\bhosts? of this kind\b", re.IGNORECASE),
    "a first-person account": re.compile(r"\b(I|we|We) (measured|adopted|ran|tried|kept|chose|found|checked|looked|rewrote)\b"),
    "a commit hash as narrative": re.compile(r"(`(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}`|\b(commit|since|at|after|before|of) (?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b)"),
    "a dated experiment": re.compile(r"\b20\d\d-\d\d-\d\d\b"),
}

# Generated blocks name the run and commit that produced them: that is provenance, not a diary.
GENERATED_BLOCK = re.compile(r"<!-- benchx-(results|seeds|benchmarks):start -->.*?<!-- benchx-\1:end -->", re.DOTALL)
GENERATED_PAGES = {"docs/results.md", "docs/seeds.md"}


def tracked_documents() -> list[str]:
    listed = subprocess.run(["git", "ls-files", "*.md", "recipes/*.yaml", "recipes/**/*.yaml", "MLproject"],
                            cwd=REPO_ROOT, capture_output=True, text=True, check=True).stdout.split()
    return sorted(set(listed) - GENERATED_PAGES)


def diary_findings(text: str) -> list[str]:
    text = GENERATED_BLOCK.sub("", text)
    found = []
    for number, line in enumerate(text.splitlines(), start=1):
        for what, pattern in DIARY_PATTERNS.items():
            match = pattern.search(line)
            if match:
                found.append(f"line {number}: {what} ({match.group(0)!r})")
    return found


@pytest.mark.parametrize("pattern_name, line", [
    ("a session number", "Measured in session 17 on main."),
    ("a UTC time", "ran at 13:16 UTC on the idle machine"),
    ("a host diary", "this host ran it faster"),
    ("a first-person account", "I measured the wait three times"),
    ("a commit hash as narrative", "the default since 16d4d6b"),
    ("a dated experiment", "chosen on validation (2026-12-02, 3,000 steps)"),
])
def test_the_diary_check_catches_each_kind_of_narrative(pattern_name, line):
    findings = diary_findings(line)
    assert findings and pattern_name in findings[0]


def test_the_diary_check_leaves_generated_results_alone():
    for name in ("results", "seeds", "benchmarks"):
        block = f"<!-- benchx-{name}:start -->\nRun abc, commit `0123456789abcdef`, 2026-12-03\n<!-- benchx-{name}:end -->"
        assert diary_findings(block) == []
    mismatched = "<!-- benchx-results:start -->\ncommit `0123456789abcdef`\n<!-- benchx-seeds:end -->"
    assert diary_findings(mismatched), "a block ends with its own marker"


def test_the_readme_blocks_are_the_generated_pages():
    """README's generated blocks say what docs/results.md and docs/seeds.md say (both written by
    ``benchx report --markdown`` from the same runs): no hand edit on one side only."""
    from synthx.workflows.pooled_page import PER_SEED_SECTION, SEEDS_BLOCK
    from synthx.workflows.report.markdown_page import fill_results_block

    readme = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    results = (REPO_ROOT / "docs" / "results.md").read_text(encoding="utf-8")
    seeds = (REPO_ROOT / "docs" / "seeds.md").read_text(encoding="utf-8")
    assert fill_results_block(readme, results) == readme
    assert fill_results_block(readme, seeds.split(PER_SEED_SECTION)[0], SEEDS_BLOCK) == readme


def test_tracked_documents_and_recipes_do_not_narrate_their_development():
    documents = tracked_documents()
    assert "README.md" in documents and any(d.startswith("recipes/") for d in documents)
    problems = {path: diary_findings((REPO_ROOT / path).read_text(encoding="utf-8")) for path in documents}
    problems = {path: found for path, found in problems.items() if found}
    assert not problems, "development narrative in tracked documents:\n" + "\n".join(
        f"{path}: {'; '.join(found[:5])}" for path, found in problems.items())


def test_the_readme_fits_on_a_few_screens():
    lines = (REPO_ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines; move details into docs/"


def test_relative_links_in_documents_resolve():
    broken = []
    for path in tracked_documents():
        if not path.endswith(".md"):
            continue
        text = (REPO_ROOT / path).read_text(encoding="utf-8")
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            file_part = target.split("#", 1)[0]
            if not (REPO_ROOT / path).parent.joinpath(file_part).exists():
                broken.append(f"{path}: {target}")
    assert not broken, "links to files that do not exist: " + ", ".join(broken)


# What the main job's and the pooled study's figures depend on: a change here makes generated results stale.
RESULT_CODE_PATHS = ("lightning_modules", "synthx", "recipes", "splits", "MLproject", "pyproject.toml",
                     ".ci/constraints.txt", ".ci/setup")
# The benchmarks' figures also depend on the scripts that measured them.
BLOCK_CODE_PATHS = {"benchmarks": (*RESULT_CODE_PATHS, "benchmarks")}
GENERATED_COMMIT = re.compile(r"at commit `([0-9a-f]{40})`")


def stale_generated_blocks(texts: dict[str, str], head: str = "HEAD") -> list[str]:
    """The generated blocks (README's and the pages') whose commit is unknown or whose code path
    (RESULT_CODE_PATHS) has changed between that commit and ``head``."""
    stale = []
    for name, text in texts.items():
        for block in GENERATED_BLOCK.finditer(text):
            paths = BLOCK_CODE_PATHS.get(block.group(1), RESULT_CODE_PATHS)
            if "uncommitted changes" in block.group(0):
                stale.append(f"{name}: its {block.group(1)} block measured uncommitted code")
            for commit in GENERATED_COMMIT.findall(block.group(0)):
                known = subprocess.run(["git", "cat-file", "-e", f"{commit}^{{commit}}"], cwd=REPO_ROOT).returncode == 0
                if not known:
                    stale.append(f"{name}: commit {commit} is not in this repository's history")
                    continue
                changed = subprocess.run(["git", "diff", "--name-only", commit, head, "--", *paths],
                                         cwd=REPO_ROOT, capture_output=True, text=True, check=True).stdout.split()
                if changed:
                    stale.append(f"{name}: generated at {commit[:12]}, since then {len(changed)} file(s) of its "
                                 f"code path changed (e.g. {', '.join(changed[:3])})")
    return stale


def test_generated_results_come_from_the_current_code():
    """README's and the docs' generated blocks name the commit whose code made them; that commit's code
    path must be the current one (regenerate with ``benchx report --markdown`` after a change)."""
    texts = {name: (REPO_ROOT / name).read_text(encoding="utf-8")
             for name in ("README.md", *sorted(GENERATED_PAGES), "docs/benchmarks.md")}
    # A page without figures (no run of the current code yet) names no commit and passes; one with
    # figures names its commit (test_a_block_generated_before_a_code_change_is_stale plants an old one).
    stale = stale_generated_blocks(texts)
    assert not stale, "results generated from other code:\n" + "\n".join(stale)


def test_a_block_generated_before_a_code_change_is_stale():
    first = subprocess.run(["git", "rev-list", "--max-parents=0", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                           text=True, check=True).stdout.split()[0]
    block = f"<!-- benchx-results:start -->\nrun at commit `{first}`.\n<!-- benchx-results:end -->"
    assert stale_generated_blocks({"README.md": block}), "the first commit's code is not today's"
    unknown = block.replace(first, "0" * 40)
    assert "not in this repository's history" in stale_generated_blocks({"README.md": unknown})[0]


def test_a_benchmarks_block_is_stale_when_only_a_benchmark_script_changed():
    """The benchmarks' figures depend on the scripts too; a trial page of uncommitted code never passes."""
    def git(*args):
        return subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, check=True).stdout.split()

    # A commit that changed benchmark scripts and none of the results' code path.
    scripts_only = next(c for c in git("log", "--format=%H", "--", "benchmarks")
                        if git("rev-list", "--parents", "-n", "1", c)[1:]
                        and not git("diff", "--name-only", f"{c}^", c, "--", *RESULT_CODE_PATHS))
    for name, expected_stale in (("benchmarks", True), ("results", False)):
        block = f"<!-- benchx-{name}:start -->\nat commit `{git('rev-parse', scripts_only + '^')[0]}`.\n<!-- benchx-{name}:end -->"
        assert bool(stale_generated_blocks({"docs/benchmarks.md": block}, head=scripts_only)) == expected_stale, name
    dirty = f"<!-- benchx-benchmarks:start -->\nat commit `{scripts_only}` with uncommitted changes\n<!-- benchx-benchmarks:end -->"
    assert "uncommitted" in stale_generated_blocks({"docs/benchmarks.md": dirty}, head=scripts_only)[0]


def test_the_benchmarks_page_has_no_hand_typed_table():
    """Every table of docs/benchmarks.md sits in the block benchmarks/write_page.py writes."""
    page = (REPO_ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    blocks = [b for b in GENERATED_BLOCK.finditer(page) if b.group(1) == "benchmarks"]
    assert len(blocks) == 1, "docs/benchmarks.md needs its generated block"
    outside = [line for line in GENERATED_BLOCK.sub("", page).splitlines() if line.lstrip().startswith("|")]
    assert not outside, f"table rows typed by hand: {outside[:3]}"
    assert "| benchmark (script) |" in blocks[0].group(0)


CITATION = re.compile(r"(docs/[\w/.-]+\.md) \\?\"([^\"\\]+)")


def test_the_sections_code_cites_exist():
    """``docs/<page>.md "Section"`` in code and help texts names a heading of that page (a title cut
    by a line break counts by its start)."""
    sources = subprocess.run(["git", "ls-files", "*.py", "MLproject", "recipes/*.yaml", "recipes/**/*.yaml"],
                             cwd=REPO_ROOT, capture_output=True, text=True, check=True).stdout.split()
    headings: dict[str, list[str]] = {}
    missing = []
    for source in sources:
        for page, title in CITATION.findall((REPO_ROOT / source).read_text(encoding="utf-8")):
            if page not in headings:
                path = REPO_ROOT / page
                headings[page] = re.findall(r"(?m)^#+ (.+)$", path.read_text(encoding="utf-8")) if path.exists() else []
            title = " ".join(title.split())
            if not any(heading.startswith(title) for heading in headings[page]):
                missing.append(f"{source}: {page} \"{title}\"")
    assert sum(len(v) for v in headings.values()) > 20, "no citation found: the pattern is wrong"
    assert not missing, "citations of sections that do not exist: " + "; ".join(sorted(set(missing))[:20])
