"""The versions of the libraries hf-rebasin works with, checked when the package is imported.

The bounds live in one place, pyproject.toml; they reach the installed package's metadata, which is what
is read here.  A library older than its bound is reported at import time, naming the package, the version
found and the one required (an old transformers would otherwise misread a config before anything fails)."""
from __future__ import annotations

from importlib import metadata

from packaging.requirements import Requirement
from packaging.version import Version


class DependencyVersionError(ImportError):
    """An installed library is older than hf-rebasin needs."""


def lower_bounds(distribution: str = "hf-rebasin") -> dict[str, Version]:
    """{package: minimum version} from the `>=` clauses of the package's own requirements (extras left out)."""
    try:
        requirements = metadata.requires(distribution) or []
    except metadata.PackageNotFoundError:  # imported from a source tree that was never installed
        return {}
    bounds = {}
    for text in requirements:
        requirement = Requirement(text)
        if requirement.marker is not None and "extra" in str(requirement.marker):
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


def installed_versions(packages: tuple[str, ...] = ("hf-rebasin", "torch", "transformers", "timm")) -> dict:
    """{package: version or None} as recorded in reports (keys with '_' for '-')."""
    found = {}
    for package in packages:
        try:
            found[package.replace("-", "_")] = metadata.version(package)
        except metadata.PackageNotFoundError:
            found[package.replace("-", "_")] = None
    return found
