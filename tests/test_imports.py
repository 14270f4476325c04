"""The package's shape: its modules import one another in one direction (no import circles, function-level
imports included: a deferred import hides a circle from Python, not from the reader), test fixtures stay out of
the library, and no module outgrows one idea.  The imports are read with `ast` from the source files, so the
test sees every module, imported or not."""
from __future__ import annotations

import ast
from pathlib import Path

import hf_rebasin

PACKAGE = Path(hf_rebasin.__file__).parent


def module_names(root: Path = PACKAGE) -> dict[str, tuple[Path, bool]]:
    """{dotted name: (file, whether it is a package's __init__)} of every module under root."""
    modules = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        modules[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return modules


def imported_modules(node: ast.AST, module: str, is_package: bool, modules) -> set[str]:
    """The package's modules an import statement names (`from X import a` names X.a when that is a module,
    else X; relative imports are resolved from `module`)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            package = module.split(".") if is_package else module.split(".")[:-1]
            base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
        names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
    else:
        return set()
    found = set()
    for name in names:
        while name and name not in modules:  # `import a.b.attr` or a name inside a module: its module
            name = name.rpartition(".")[0]
        if name and name != module:
            found.add(name)
    return found


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """{module: the package's modules it imports anywhere in its file}."""
    modules = module_names(root)
    return {name: set().union(*(imported_modules(node, name, is_package, modules)
                                for node in ast.walk(ast.parse(path.read_text()))))
            for name, (path, is_package) in modules.items()}


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for target in graph[todo.pop()]:
            if target not in seen:
                seen.add(target)
                todo.append(target)
    return seen


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module: modules that import each other, directly or
    through others."""
    reach = {module: reachable(graph, module) for module in graph}
    components = {frozenset({m} | {n for n in reach[m] if m in reach[n]}) for m in graph}
    return sorted(sorted(c) for c in components if len(c) > 1)


def test_the_import_graph_is_read_from_the_sources():
    graph = import_graph()
    assert "hf_rebasin.match.weight" in graph["hf_rebasin.match"]  # a function-level import counts
    assert "hf_rebasin.match.alignment" in graph["hf_rebasin.match.weight"]  # relative, `from .x import y`
    assert "hf_rebasin.adapters" in graph["hf_rebasin.tiny"]
    assert "hf_rebasin.cli.commands" in graph["hf_rebasin.cli.recipe_command"]  # `from . import commands`


def test_circles_are_found(tmp_path):
    """The check fails on a circle, also one closed by a deferred import through a third module."""
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from .sub import b\n")
    (package / "sub" / "__init__.py").write_text("")
    (package / "sub" / "b.py").write_text("import os\nfrom ..c import thing\n")
    (package / "c.py").write_text("def thing():\n    from .a import x\n")
    (package / "d.py").write_text("from . import a\n")
    assert circles(import_graph(package)) == [["pkg.a", "pkg.c", "pkg.sub.b"]]
    (package / "c.py").write_text("def thing():\n    import pkg.sub\n")  # the package, not b
    assert import_graph(package)["pkg.c"] == {"pkg.sub"} and circles(import_graph(package)) == []


def test_no_import_circles():
    found = circles(import_graph())
    assert not found, "modules that import each other: " + "; ".join(" <-> ".join(c) for c in found)


# The folders of the package in the order a merge runs (adapters/ sits between the canonical graph it converts to
# and the sources that read checkpoints through it); the top-level modules are the API, the pipeline and what
# every stage shares.
STAGES = ["core", "adapters", "sources", "match", "evaluation", "export", "hub", "cli"]


def stage_of(module: str) -> int | None:
    parts = module.split(".")
    return STAGES.index(parts[1]) if len(parts) > 1 and parts[1] in STAGES else None


def test_no_stage_imports_a_later_stage():
    """An import goes down the flow or stays in its stage: sources/ never imports match/, match/ never imports
    evaluation/ or export/, and so on."""
    graph = import_graph()
    climbs = sorted(f"{module} -> {target}" for module, targets in graph.items() for target in targets
                    if stage_of(module) is not None and stage_of(target) is not None
                    and stage_of(target) > stage_of(module))
    assert not climbs, climbs


def test_test_fixtures_stay_out_of_the_package():
    """tiny.py (tiny random models and a character tokenizer for tests, demos and benchmarks) sits on top: no
    module of the library imports it."""
    graph = import_graph()
    users = sorted(module for module, targets in graph.items() if "hf_rebasin.tiny" in targets)
    assert users == []


def test_every_module_is_at_most_450_lines():
    """A module longer than that holds more than one idea: split it by idea (recipes.py / recipe_checks.py)."""
    long = {str(path.relative_to(PACKAGE)): n for path in PACKAGE.rglob("*.py")
            if (n := len(path.read_text().splitlines())) > 450}
    assert not long, long
