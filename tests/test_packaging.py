"""What a clone alone and a wheel alone need: packaged assets found without the source tree, honest
version bounds checked at import, and no silent guards around the project's own modules."""
from __future__ import annotations

import importlib
from pathlib import Path

import pytest
from packaging.version import Version

from hf_rebasin import assets, requirements


def test_assets_are_package_data():
    import hf_rebasin
    package = assets.asset().parent
    assert package == importlib.resources.files(hf_rebasin)  # found through the package, not the repository
    pair = assets.example_pair()
    for name in ("model-a/config.json", "model-a/model.safetensors", "model-a/tokenizer.json",
                 "model-b/model.safetensors", "heldout.txt", "README.md"):
        assert (pair / name).is_file(), name
    assert assets.card_template().read_text().startswith("---")
    assert {p.stem for p in assets.recipes_dir().glob("*.yaml")} >= {"pythia-1b", "example-stdlib"}


def test_package_data_globs_cover_every_asset():
    """Every file under hf_rebasin/assets must be matched by the wheel's package-data globs."""
    import fnmatch
    import tomllib
    root = assets.asset().parent
    pyproject = tomllib.loads((root.parent / "pyproject.toml").read_text())
    globs = pyproject["tool"]["setuptools"]["package-data"]["hf_rebasin"]
    files = [p.relative_to(root).as_posix() for p in assets.asset().rglob("*")
             if p.is_file() and p.suffix != ".py" and "__pycache__" not in p.parts]
    assert files
    missed = [f for f in files if not any(fnmatch.fnmatch(f, g) and f.count("/") == g.count("/") for g in globs)]
    assert not missed, f"not in the wheel: {missed}"


def test_recipes_and_card_template_are_top_level_folders_in_the_wheel():
    """recipes/ and model_cards/ sit at the top of the repository, beside hf_rebasin (as they do in site-packages
    once the wheel is installed), and the wheel's packages and package-data globs take every file in them."""
    import fnmatch
    import tomllib

    import hf_rebasin
    top = Path(hf_rebasin.__file__).parent.parent
    assert assets.recipes_dir() == top / "recipes"
    assert assets.card_template() == top / "model_cards" / "template.md"
    setuptools = tomllib.loads((top / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert {"recipes", "model_cards"} <= set(setuptools["packages"]["find"]["include"])
    for folder in ("recipes", "model_cards"):
        files = [p.relative_to(top / folder).as_posix() for p in (top / folder).rglob("*")
                 if p.is_file() and p.suffix != ".py" and "__pycache__" not in p.parts]
        assert files, folder
        globs = setuptools["package-data"][folder]
        missed = [f for f in files if not any(fnmatch.fnmatch(f, g) and f.count("/") == g.count("/") for g in globs)]
        assert not missed, f"not in the wheel: {folder}/{missed}"


def test_the_design_the_code_cites_is_in_the_repository():
    """Every "docs/design.md §n" in the package, the tests and the README names a section of docs/design.md, and
    nothing cites a design document outside the repository."""
    import re

    import hf_rebasin
    top = Path(hf_rebasin.__file__).parent.parent
    sections = set(re.findall(r"^## (\d+)\. ", (top / "docs" / "design.md").read_text(), flags=re.M))
    assert len(sections) >= 7
    files = [*(top / "hf_rebasin").rglob("*.py"), *(top / "tests").glob("*.py"), top / "README.md"]
    cited, outside = set(), []
    for path in files:
        text = path.read_text()
        for first, last in re.findall(r"docs/design\.md §(\d+)(?:-(\d+))?", text):
            cited |= {(path.name, n) for n in range(int(first), int(last or first) + 1)}
        outside += [path.name for _ in re.findall(r"DESIGN(?:\.md)? §", text)]
    assert not outside, f"cite docs/design.md instead: {outside}"
    assert {n for _, n in cited} >= {2, 3, 4, 5, 7}
    assert not [(name, n) for name, n in cited if str(n) not in sections]


def test_lower_bounds_come_from_the_package_metadata():
    bounds = requirements.lower_bounds()
    for package in ("transformers", "timm", "accelerate", "huggingface_hub", "lm-eval"):
        assert package in bounds, package
    assert bounds["transformers"] >= Version("5.0")  # the code uses transformers-5 APIs
    requirements.check_installed_versions(bounds)  # this environment satisfies them


def test_an_old_dependency_is_named_at_import_time():
    bounds = {"transformers": Version("5.0"), "timm": Version("1.0.15"), "ghost-package": Version("1.0")}
    versions = {"transformers": "4.57.1", "timm": "1.0.31"}

    def version_of(package):
        if package not in versions:
            raise importlib.metadata.PackageNotFoundError(package)
        return versions[package]

    with pytest.raises(requirements.DependencyVersionError) as error:
        requirements.check_installed_versions(bounds, version_of)
    message = str(error.value)
    assert "transformers 4.57.1 is installed, hf-rebasin needs transformers>=5.0" in message
    assert "ghost-package is not installed" in message and "timm" not in message.split("Upgrade")[0]
    assert "pip install -U 'transformers>=5.0' 'ghost-package>=1.0'" in message
    assert isinstance(error.value, ImportError)


def test_a_broken_module_fails_loudly(monkeypatch):
    """No `try: import ... except ImportError` around the project's own modules: a module that cannot be
    imported is an error, never a command or a card silently missing."""
    import sys

    from hf_rebasin import cli
    from hf_rebasin.hub import evals
    monkeypatch.setitem(sys.modules, "hf_rebasin.hub.recipes", None)  # importing it now raises ImportError
    with pytest.raises(ImportError, match="hf_rebasin.hub.recipes"):
        cli.build_parser()
    monkeypatch.setitem(sys.modules, "hf_rebasin.hub.cards", None)
    with pytest.raises(ImportError, match="hf_rebasin.hub.cards"):
        evals.refresh_card(assets.asset(), "x")
