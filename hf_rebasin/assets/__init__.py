"""Files that ship inside the package (and so inside the wheel): the model-card template, the bundled
recipes and the example pair of ``hf-rebasin demo``.  Found with importlib.resources, never through the
source tree, so that a plain ``pip install`` has everything."""
from __future__ import annotations

from importlib import resources
from pathlib import Path


def asset(*parts: str) -> Path:
    """The path of a packaged file or folder (a real folder: pip installs wheels unzipped)."""
    return Path(str(resources.files(__name__).joinpath(*parts)))


def example_pair() -> Path:
    """The bundled example pair: model-a/, model-b/ and heldout.txt (see its README.md)."""
    return asset("example-pair")


def recipes_dir() -> Path:
    return asset("recipes")


def card_template() -> Path:
    return asset("card.md")
