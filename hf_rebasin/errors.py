"""What can go wrong that the user can fix.  Every library error derives from UserError; the command line
prints its message on one line and exits with code 2 (anything else is a bug and keeps its traceback)."""
from __future__ import annotations


class UserError(Exception):
    """A problem with what was asked for (options, files, models, data); the message names it and the fix."""


class OptionError(UserError, ValueError):
    """An option value out of range, or options that do not go together."""


class ModelLoadError(UserError, ValueError):
    """The source is not a loadable model (missing, not a model folder, corrupt or non-finite weights)."""


class IncompatibleModelsError(UserError, ValueError):
    """Models that cannot be aligned with each other (architecture, shapes, vocabulary)."""


class UnsupportedModelError(UserError, ValueError):
    """The model's class or one of its features is outside what hf-rebasin can align exactly."""


class DataError(UserError, ValueError):
    """A data spec that cannot be read; the message names the file or spec and what to do about it."""


class OutputError(UserError):
    """The output location cannot be used (a file, unwritable, inside a source, not ours to replace)."""


class RebasinWarning(UserWarning):
    """Something the user should know that does not stop the work (the command line prints it on one line)."""
