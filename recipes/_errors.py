"""The recipes' configuration errors, apart from ``_common`` so that the CLI can catch them without Lightning."""

from __future__ import annotations

__all__ = ["MissingDataError", "RecipeConfigError"]


class RecipeConfigError(ValueError):
    """A recipe's configuration cannot work (impossible shapes, bad values); the CLI prints it in one line."""


class MissingDataError(RecipeConfigError, FileNotFoundError):
    """A recipe's ``data_dir`` is missing or lacks the expected layout (which the message shows)."""
