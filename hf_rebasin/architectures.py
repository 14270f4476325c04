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
