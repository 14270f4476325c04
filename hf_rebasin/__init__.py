"""hf-rebasin: merge independently trained transformers by aligning their symmetries."""
from .requirements import check_installed_versions

__version__ = "0.1.0"

check_installed_versions()
