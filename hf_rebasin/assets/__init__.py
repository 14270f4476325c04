"""Files hf-rebasin reads at run time: the bundled recipes (the repository's top-level ``recipes`` folder), the
model-card template (its top-level ``model_cards`` folder) and the example pair of ``hf-rebasin demo`` (here,
beside this file, package data).  The wheel ships the two top-level folders inside the package, as
``hf_rebasin.recipes`` and ``hf_rebasin.model_cards`` (a package-dir mapping in pyproject.toml: no generic
top-level name in site-packages); a source checkout (a clone on sys.path, or an editable install) has them beside
``hf_rebasin/``, and uses its own."""
from __future__ import annotations

from importlib import resources
from pathlib import Path


def _files(package: str, *parts: str) -> Path:
    """The path of a file or folder inside a package (a real folder: pip installs wheels unzipped)."""
    return Path(str(resources.files(package).joinpath(*parts)))


def asset(*parts: str) -> Path:
    """The path of a file or folder of this package (the example pair)."""
    return _files(__name__, *parts)


def example_pair() -> Path:
    """The bundled example pair: model-a/, model-b/ and heldout.txt (see its README.md)."""
    return asset("example-pair")


def _shipped(folder: str) -> Path:
    """A top-level folder of the repository: the checkout's own, else the wheel's hf_rebasin.<folder>."""
    checkout = Path(__file__).parents[2]
    if (checkout / "pyproject.toml").is_file() and (checkout / folder / "__init__.py").is_file():
        return checkout / folder
    return _files(f"hf_rebasin.{folder}")


def recipes_dir() -> Path:
    return _shipped("recipes")


def card_template() -> Path:
    return _shipped("model_cards") / "template.md"
