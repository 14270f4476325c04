"""Files hf-rebasin reads at run time: the bundled recipes (the top-level ``recipes`` folder), the model-card
template (the top-level ``model_cards`` folder) and the example pair of ``hf-rebasin demo`` (here, beside this
file).  All three are found by importlib.resources through a package, never through the source tree: the same
lookup works in a clone (the repository root is on sys.path, or an editable install maps it) and in an installed
wheel, which carries the two top-level folders as the packages ``recipes`` and ``model_cards``."""
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


def recipes_dir() -> Path:
    return _files("recipes")


def card_template() -> Path:
    return _files("model_cards", "template.md")
