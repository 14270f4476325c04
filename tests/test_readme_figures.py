"""Figures that cannot go stale (issue 44, point 7): the demo's figures that README.md and BENCHMARKS.md quote are
what `hf-rebasin demo` prints today, and every benchmark script the documents name is in the repository."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from hf_rebasin.cli import main

TOP = Path(__file__).resolve().parents[1]
MARKER = "<!-- the demo's figures: tests/test_readme_figures.py reads this table -->"
COLUMNS = ("barrier", "loss A", "loss B", "midpoint")
DOCUMENTS = [TOP / "README.md", TOP / "BENCHMARKS.md", *sorted((TOP / "docs").glob("*.md"))]


def quoted_demo_figures(path: Path) -> dict[str, tuple[tuple[float, int], ...]]:
    """The rows of the table under MARKER: method -> ((value, decimals quoted), ...) in the order of COLUMNS."""
    text = path.read_text()
    assert text.count(MARKER) == 1, f"{path.name}: the demo's table is marked by {MARKER!r}, once"
    rows = {}
    for line in text.split(MARKER, 1)[1].lstrip("\n").splitlines():
        if not line.startswith("|"):
            break
        cells = [cell.strip(" *") for cell in line.strip().strip("|").split("|")]
        if cells[0] in ("method", "") or set(cells[0]) <= set("-:"):
            continue
        assert len(cells) == 1 + len(COLUMNS), f"{path.name}: {line!r} is not method + {COLUMNS}"
        rows[cells[0]] = tuple((float(c), len(c.partition(".")[2])) for c in cells[1:])
    return rows


def printed_demo_figures(printed: str) -> dict[str, tuple[float, ...]]:
    """The summary table `hf-rebasin demo` prints last: method, barrier, loss A, loss B, midpoint."""
    rows = {}
    for line in printed.splitlines():
        found = re.fullmatch(r"(\S+)((?:\s+-?\d+\.\d+){4})\s*", line)
        if found:
            rows[found.group(1)] = tuple(float(v) for v in found.group(2).split())
    return rows


@pytest.fixture(scope="module")
def demo_printed(tmp_path_factory) -> str:
    import contextlib
    import io
    out = tmp_path_factory.mktemp("demo") / "demo"
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        assert main(["demo", "--out", str(out)]) == 0
    return buffer.getvalue()


@pytest.mark.parametrize("document", ["README.md", "BENCHMARKS.md"])
def test_the_quoted_demo_figures_are_what_the_demo_prints(demo_printed, document):
    printed = printed_demo_figures(demo_printed)
    quoted = quoted_demo_figures(TOP / document)
    assert set(printed) == {"raw", "wm"}, demo_printed
    assert set(quoted) == set(printed), f"{document} quotes the demo's methods {sorted(quoted)}"
    for method, values in quoted.items():
        for column, (value, decimals), measured in zip(COLUMNS, values, printed[method]):
            # the quote is the printed figure (4 decimals) rounded to the decimals quoted: half a unit of the
            # quote's last place, plus half a unit of the printed one's
            assert abs(measured - value) <= 0.5 * 10 ** -decimals + 0.5e-4, (
                f"{document}: the demo's {method} {column} is quoted as {value}, `hf-rebasin demo` prints "
                f"{measured}: update the table under {MARKER!r}")


def named_paths(text: str) -> set[str]:
    """Every `benchmarks/...` path a document names, with shell braces expanded ({a,b} -> a, b)."""
    names = set()
    for name in re.findall(r"benchmarks/[\w./{},*-]*\w", text):
        expanded = [name]
        while any("{" in n for n in expanded):
            done = []
            for n in expanded:
                found = re.search(r"\{([^{}]*)\}", n)
                done += [n[:found.start()] + part + n[found.end():] for part in found.group(1).split(",")] \
                    if found else [n]
            expanded = done
        names |= set(expanded)
    return names


def test_named_paths_are_expanded():
    assert named_paths("`benchmarks/logs/x-{a,b}.json` and benchmarks/pairs.py --x") == {
        "benchmarks/logs/x-a.json", "benchmarks/logs/x-b.json", "benchmarks/pairs.py"}


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: p.name)
def test_every_benchmark_script_a_document_names_is_in_the_repository(document):
    names = named_paths(document.read_text())
    missing = sorted(n for n in names if not any(TOP.glob(n)) and not (TOP / n).exists())
    assert not missing, f"{document.name} names benchmark files that are not in the repository: {missing}"


def anchors(path: Path) -> set[str]:
    """The anchors GitHub gives a Markdown file's headings (lower case, punctuation dropped, spaces as '-'; a repeated
    heading gets -1, -2, ...)."""
    found: set[str] = set()
    for line in path.read_text().splitlines():
        if line.startswith("#"):
            slug = candidate = re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
            repeat = 0
            while candidate in found:
                repeat += 1
                candidate = f"{slug}-{repeat}"
            found.add(candidate)
    return found


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: p.name)
def test_every_link_between_the_documents_reaches_a_file_and_heading(document):
    broken = []
    for target, anchor in re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]+))?\)", document.read_text()):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        path = (document.parent / target).resolve() if target else document
        if not path.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            broken.append(f"{target}#{anchor} (no such heading)")
    assert not broken, f"{document.name}: {broken}"


def test_the_counts_of_bad_input_the_guide_quotes_are_the_tests():
    import test_bad_input
    text = (TOP / "docs" / "reliability.md").read_text()
    values, flags = map(int, re.search(r"\*\*(\d+) out-of-range values over (\d+) flags\*\*", text).groups())
    combinations = int(re.search(r"\*\*(\d+) listed invalid options and combinations\*\*", text).group(1))
    cases = [case.values for case in test_bad_input.BAD_FLAG_CASES]
    assert (values, flags) == (len(cases), len({case[3] for case in cases}))
    assert combinations == len(test_bad_input.REFUSED_OPTIONS)


def test_every_figure_of_the_readmes_expectations_is_in_the_benchmarks():
    """The README's "What to expect" table copies figures from BENCHMARKS.md (which gives each its command): a figure
    changed or mistyped in one and not the other fails here."""
    section = (TOP / "README.md").read_text().split("## What to expect", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    assert len(rows) >= 5, "the README's table of what to expect: one row per method"
    benchmarks = (TOP / "BENCHMARKS.md").read_text()
    figures = {figure for row in rows for figure in re.findall(r"(?<![\w.])\d+\.\d+(?!\d)", row)}
    missing = sorted(f for f in figures if not re.search(rf"(?<![\d.]){re.escape(f)}(?!\d)", benchmarks))
    assert not missing, f"README.md's table of what to expect quotes figures BENCHMARKS.md does not give: {missing}"
