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


def test_a_checkout_uses_its_own_recipes_and_card_template():
    """recipes/ and model_cards/ sit at the top of the repository, beside hf_rebasin; a checkout reads its own, and
    pyproject.toml maps them into the wheel as hf_rebasin.recipes and hf_rebasin.model_cards, with globs that take
    every file in them."""
    import fnmatch
    import tomllib

    import hf_rebasin
    top = Path(hf_rebasin.__file__).parent.parent
    assert assets.recipes_dir() == top / "recipes"
    assert assets.card_template() == top / "model_cards" / "template.md"
    setuptools = tomllib.loads((top / "pyproject.toml").read_text())["tool"]["setuptools"]
    for folder in ("recipes", "model_cards"):
        package = f"hf_rebasin.{folder}"
        assert setuptools["package-dir"][package] == folder and package in setuptools["packages"]
        files = [p.relative_to(top / folder).as_posix() for p in (top / folder).rglob("*")
                 if p.is_file() and p.suffix != ".py" and "__pycache__" not in p.parts]
        assert files, folder
        globs = setuptools["package-data"][package]
        missed = [f for f in files if not any(fnmatch.fnmatch(f, g) and f.count("/") == g.count("/") for g in globs)]
        assert not missed, f"not in the wheel: {folder}/{missed}"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel, built as users build it (`pip wheel --no-deps`, isolated) from a copy of what it is made of."""
    import shutil
    import subprocess
    import sys

    import hf_rebasin
    top = Path(hf_rebasin.__file__).parent.parent
    root = tmp_path_factory.mktemp("wheel")
    source = root / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(top / name, source)
    for folder in ("hf_rebasin", "recipes", "model_cards"):
        shutil.copytree(top / folder, source / folder, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(root / "dist"), str(source)],
                   check=True, capture_output=True, timeout=300)
    (built,) = (root / "dist").glob("hf_rebasin-*.whl")
    return built


def test_the_wheel_has_one_top_level_package_holding_every_module_and_asset(wheel):
    import zipfile

    import hf_rebasin
    top = Path(hf_rebasin.__file__).parent.parent
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {name.split("/")[0] for name in names} == {"hf_rebasin", wheel.name.split("-py")[0] + ".dist-info"}
    tree = {f"hf_rebasin/{p.relative_to(top / 'hf_rebasin').as_posix()}" for p in (top / "hf_rebasin").rglob("*")
            if p.is_file() and "__pycache__" not in p.parts}
    for folder in ("recipes", "model_cards"):
        tree |= {f"hf_rebasin/{folder}/{p.name}" for p in (top / folder).iterdir() if p.is_file()}
    assert tree - names == set(), "files of the tree missing from the wheel"


def test_the_wheel_declares_ranges_and_image_support_as_an_extra(wheel):
    import email
    import zipfile

    from packaging.requirements import Requirement
    archive = zipfile.ZipFile(wheel)
    (metadata_name,) = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
    metadata = email.message_from_bytes(archive.read(metadata_name))
    assert "<" not in metadata["Requires-Python"] and metadata["Requires-Python"] == ">=3.11"
    requirements = [Requirement(text) for text in metadata.get_all("Requires-Dist")]
    assert not [str(r) for r in requirements if any(c.operator in ("==", "===", "~=") for c in r.specifier)]
    core = {r.name: r for r in requirements if r.marker is None}
    vision = {r.name for r in requirements if r.marker is not None and r.marker.evaluate({"extra": "vision"})}
    assert str(core["torch"].specifier) == ">=2.13"  # the oldest torch CI runs the suite under (.ci/run)
    assert {"timm", "torchvision"} <= vision and not {"timm", "torchvision"} & set(core)


def test_the_installed_wheel_finds_its_assets_inside_the_package(wheel, tmp_path):
    """Unpacked as pip installs it, away from any checkout: the recipes, the card template and the example pair
    come from hf_rebasin/ in the install."""
    import os
    import subprocess
    import sys
    import zipfile
    site = tmp_path / "site-packages"
    zipfile.ZipFile(wheel).extractall(site)
    found = subprocess.run(
        [sys.executable, "-c", "from hf_rebasin import assets\n"
         "print(assets.recipes_dir(), assets.card_template(), assets.example_pair(), sep='\\n')"],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(site)}, capture_output=True, text=True, check=True)
    recipes, template, pair = map(Path, found.stdout.split())
    assert recipes == site / "hf_rebasin" / "recipes" and (recipes / "pythia-1b.yaml").is_file()
    assert template == site / "hf_rebasin" / "model_cards" / "template.md" and template.is_file()
    assert pair == site / "hf_rebasin" / "assets" / "example-pair"


def test_an_image_model_without_timm_names_the_extra(tmp_path, monkeypatch, capsys):
    import sys

    from hf_rebasin import tiny
    from hf_rebasin.cli import main
    from hf_rebasin.sources import models
    vit = tiny.make_tiny("vit", tmp_path / "vit")
    for module in [m for m in sys.modules if m == "timm" or m.startswith("timm.")]:
        monkeypatch.delitem(sys.modules, module)
    monkeypatch.setitem(sys.modules, "timm", None)  # importing timm now fails as when it is not installed
    with pytest.raises(requirements.MissingExtraError, match=r'pip install "hf-rebasin\[vision\]"'):
        models.load(vit)
    assert main(["inspect", str(vit)]) == 2
    error = capsys.readouterr().err
    assert "timm is not installed" in error and 'pip install "hf-rebasin[vision]"' in error


def test_the_design_the_code_cites_is_in_the_repository():
    """Every "docs/design.md §n" in the package, the tests, the README and the guides names a section of
    docs/design.md, and nothing cites a design document outside the repository."""
    import re

    import hf_rebasin
    top = Path(hf_rebasin.__file__).parent.parent
    sections = set(re.findall(r"^## (\d+)\. ", (top / "docs" / "design.md").read_text(), flags=re.M))
    assert len(sections) >= 7
    files = [*(top / "hf_rebasin").rglob("*.py"), *(top / "tests").glob("*.py"), top / "README.md",
             *(path for path in (top / "docs").glob("*.md") if path.name != "design.md")]
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
    for package in ("torch", "transformers", "accelerate", "huggingface_hub", "lm-eval"):
        assert package in bounds, package
    assert bounds["transformers"] >= Version("5.0")  # the code uses transformers-5 APIs
    vision = requirements.lower_bounds(extra="vision")
    assert set(vision) == {"timm", "torchvision"} and not set(vision) & set(bounds)
    requirements.check_installed_versions(bounds | vision)  # this environment satisfies them


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
