"""The release of hf-rebasin: the wheel's version (pyproject reads it), ``--version`` and every report's record."""
__version__ = "0.1.0"
