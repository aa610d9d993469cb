"""The README and the docs/ pages hang together: every page is reachable from the README,
every page and RESULTS section they name exists, and the bad-input catalogue names real
tests. (Their commands run in ``test_readme.py``.)"""

import re
from pathlib import Path

REPO = Path(__file__).parent.parent
README = REPO / "README.md"
PAGES = sorted((REPO / "docs").glob("*.md"))
RESULTS = REPO / "eval" / "RESULTS.md"
TEXT_SUFFIXES = {".py", ".md", ".yaml", ".sh", ".txt"}


def _text(path: Path) -> str:
    return " ".join(path.read_text().split())  # names may wrap across lines


def test_every_docs_page_is_linked_from_the_readme():
    readme = README.read_text()
    assert PAGES
    missing = [p.name for p in PAGES if f"(docs/{p.name})" not in readme]
    assert not missing, f"docs pages the README does not link: {missing}"


def test_every_named_page_exists():
    for page in [README, *PAGES]:
        for name in re.findall(r"\bdocs/([\w-]+\.md)\b", page.read_text()):
            assert (REPO / "docs" / name).is_file(), f"{page.name} names docs/{name}"


def test_readme_stays_short():
    assert len(README.read_text().splitlines()) <= 150


def _results_sections() -> list[str]:
    """RESULTS.md's section titles without their numbers ('## 4. The demo' -> 'The demo')."""
    heads = re.findall(r"^##+ (.*)$", RESULTS.read_text(), flags=re.M)
    return [re.sub(r"^\d+\.\s*", "", h) for h in heads]


def test_named_results_sections_exist():
    sections = _results_sections()
    refs = []
    for page in [README, *PAGES]:
        text = _text(page)
        refs += [(page.name, r) for r in re.findall(r'RESULTS\.md,? \(?"([^"]+)"', text)]
        # docs/benchmarks.md's table: | `eval.module` | what | "section" |
        rows = re.findall(r'^\| `eval\.\w+` \|.*\| "([^"]+)" \|$', page.read_text(), flags=re.M)
        refs += [(page.name, r) for r in rows]
    assert refs
    unknown = [(p, r) for p, r in refs if not any(s.startswith(r) for s in sections)]
    assert not unknown, f"RESULTS sections named but not found: {unknown}"


def test_results_stays_one_table_per_benchmark():
    """RESULTS.md is the current figures, not a diary: it stays short enough to read."""
    assert len(RESULTS.read_text().splitlines()) <= 465


def test_code_points_at_commands_not_at_results_sections():
    """Sections move: a comment names the command that measures its claim, and a page names a
    RESULTS section by its title, never by its number."""
    numbered = re.compile(r"RESULTS(?:\.md)?(?:'s)?,?\s*\(?(?:section|§)?\s*\d")
    files = [p for top in ("speculators_peagle_plugin", "eval", "tools", "configs", "docs", "tests")
             for p in (REPO / top).rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES]
    hits = [f"{p.relative_to(REPO)}: {m.group(0)}" for p in [README, *files] if p != RESULTS
            for m in numbered.finditer(_text(p))]
    assert not hits, hits


def test_the_bad_input_catalogue_names_real_tests():
    page = (REPO / "docs" / "bad_input.md").read_text()
    rows = [line for line in page.splitlines() if line.startswith("| ") and "---" not in line]
    named = 0
    for row in rows[1:]:
        test_cell = row.rstrip(" |").rsplit(" | ", 1)[-1]
        if test_cell == "test":  # a header row
            continue
        files = re.findall(r"`(test_\w+\.py)`", test_cell)
        assert files or "same" in test_cell or "not in the suite" in test_cell, row
        # `file.py` `name`, `name2`, `other.py` `name3`: each name is defined in the file before it
        file = None
        for token in re.findall(r"`(test_\w+(?:\.py)?)(?:\[[^\]]*\])?`", test_cell):
            if token.endswith(".py"):
                file = token
                continue
            assert f"def {token}(" in (REPO / "tests" / file).read_text(), f"{file} has no {token}"
            named += 1
    assert named >= 30
