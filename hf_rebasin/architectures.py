"""The model classes the adapters register, read from the adapters' source files (`@register` classes and their
`architecture`) without importing them: the adapters import torch, and `hf-rebasin --help` should not wait for
it.  tests/test_names_and_checks.py checks that this list is the registry's."""
from __future__ import annotations

import ast
from pathlib import Path

ADAPTERS = Path(__file__).parent / "adapters"


def registered_architectures() -> list[str]:
    """The architecture names of every registered adapter, sorted."""
    names = set()
    for path in ADAPTERS.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and any(isinstance(d, ast.Name) and d.id == "register"
                                                      for d in node.decorator_list):
                names.update(statement.value.value for statement in node.body
                             if isinstance(statement, ast.Assign) and isinstance(statement.value, ast.Constant)
                             and any(isinstance(t, ast.Name) and t.id == "architecture" for t in statement.targets))
    return sorted(names)


def masked_lm_architectures() -> set[str]:
    """The registered classes whose adapter says `task = "masked-lm"` (itself or through the adapter class it extends),
    read from the source files like registered_architectures: a refusal by name needs no torch."""
    classes: dict[str, tuple[list[str], str | None, str | None]] = {}  # name: (bases, architecture, task)
    for path in ADAPTERS.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                values = {t.id: statement.value.value for statement in node.body if isinstance(statement, ast.Assign)
                          and isinstance(statement.value, ast.Constant) for t in statement.targets
                          if isinstance(t, ast.Name)}
                classes[node.name] = ([b.id for b in node.bases if isinstance(b, ast.Name)], values.get("architecture"),
                                      values.get("task"))

    def task(name: str) -> str | None:
        bases, _, own = classes.get(name, ([], None, None))
        return own if own is not None else next((t for t in map(task, bases) if t is not None), None)

    registered = set(registered_architectures())
    return {arch for name, (_, arch, _) in classes.items() if arch in registered and task(name) == "masked-lm"}
