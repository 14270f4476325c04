"""The versions of the libraries hf-rebasin works with, checked when the package is imported.

The bounds live in one place, pyproject.toml; they reach the installed package's metadata, which is what
is read here.  A library older than its bound is reported at import time, naming the package, the version
found and the one required (an old transformers would otherwise misread a config before anything fails).
The libraries of an extra (``vision``: timm, torchvision) are checked, and named if missing, when first used."""
from __future__ import annotations

import importlib
from importlib import metadata

from packaging.requirements import Requirement
from packaging.version import Version

from .errors import UserError

# the extra that brings each optional library
EXTRA_OF = {"timm": "vision", "torchvision": "vision"}


class DependencyVersionError(UserError, ImportError):
    """An installed library is older than hf-rebasin needs (a UserError too: an extra's library is checked while a
    command runs, and the command line prints it on one line)."""


class MissingExtraError(UserError, ImportError):
    """A feature needs a library of an extra that is not installed."""


def lower_bounds(distribution: str = "hf-rebasin", extra: str | None = None) -> dict[str, Version]:
    """{package: minimum version} from the `>=` clauses of the package's own requirements: the core ones, or
    with `extra` the ones that extra adds."""
    try:
        requirements = metadata.requires(distribution) or []
    except metadata.PackageNotFoundError:  # imported from a source tree that was never installed
        return {}
    bounds = {}
    for text in requirements:
        requirement = Requirement(text)
        in_extra = requirement.marker is not None and "extra" in str(requirement.marker)
        if in_extra != (extra is not None) or (in_extra and not requirement.marker.evaluate({"extra": extra})):
            continue
        for clause in requirement.specifier:
            if clause.operator == ">=":
                bounds[requirement.name] = Version(clause.version)
    return bounds


def check_installed_versions(bounds: dict[str, Version] | None = None, version_of=metadata.version) -> None:
    """Raise DependencyVersionError listing every installed package older than its bound."""
    bounds = lower_bounds() if bounds is None else bounds
    too_old = []
    for package, minimum in bounds.items():
        try:
            found = Version(version_of(package))
        except metadata.PackageNotFoundError:
            too_old.append(f"{package} is not installed (hf-rebasin needs {package}>={minimum})")
            continue
        if found < minimum:
            too_old.append(f"{package} {found} is installed, hf-rebasin needs {package}>={minimum}")
    if too_old:
        fix = " ".join(f"'{p.split()[0]}>={bounds[p.split()[0]]}'" for p in too_old)
        raise DependencyVersionError("; ".join(too_old) + f". Upgrade with: pip install -U {fix}")


def import_optional(module: str):
    """`module` (e.g. "timm.data"), from a library of an extra: MissingExtraError naming the install command if
    it is absent, DependencyVersionError if it is older than the extra's bound."""
    library = module.partition(".")[0]
    extra = EXTRA_OF[library]
    try:
        imported = importlib.import_module(module)
    except ModuleNotFoundError as error:
        missing = (error.name or "").partition(".")[0]
        if EXTRA_OF.get(missing) != extra:
            raise
        raise MissingExtraError(f"{missing} is not installed; image models (timm ViT/DeiT) need the extra "
                                f"'{extra}': pip install \"hf-rebasin[{extra}]\" (with the torchvision that "
                                f"matches your torch)") from error
    bounds = lower_bounds(extra=extra)
    check_installed_versions({library: bounds[library]} if library in bounds else {})
    return imported


def installed_versions(packages: tuple[str, ...] = ("hf-rebasin", "torch", "transformers", "timm")) -> dict:
    """{package: version or None} as recorded in reports (keys with '_' for '-')."""
    found = {}
    for package in packages:
        try:
            found[package.replace("-", "_")] = metadata.version(package)
        except metadata.PackageNotFoundError:
            found[package.replace("-", "_")] = None
    return found
